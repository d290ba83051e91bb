"""The web dashboard: a local page (and its JSON API) for a run and for this machine.

``peerd dashboard`` serves it from a DHT reader; ``peerd join --dashboard-port P`` serves it inside the daemon,
where it also controls this machine (pause, resume, volunteer rules). :mod:`.view` assembles what the page shows
(pure), :mod:`.app` serves it (aiohttp), :mod:`.security` decides who may use it.
"""
