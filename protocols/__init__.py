"""Decentralized-training protocols (the algorithms, not ``typing.Protocol`` collections).

Each module pairs a pure core (tensor math, schedules, decisions; no I/O) with an async runner that is handed the
transport it needs through the small interfaces declared in :mod:`protocols.interfaces`; where one file would
outgrow ~500 lines it is a subpackage with one concept a module (``allreduce``, ``codecs``, ``diloco``,
``matchmaking``, ``rpc``, ``stage_service``). Nothing here imports ``peerd``, hivemind or libp2p: the daemon
(``peerd``) depends on this package, never the other way round.
"""
