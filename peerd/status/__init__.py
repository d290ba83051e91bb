"""The status records peers keep in the DHT (what ``peerd status`` and the dashboard read).

- :mod:`peerd.status.records`: the record's schema, its checks, and the contribution ranking.
- :mod:`peerd.status.history`: the compact recent history (loss, held-out loss, tokens/s) a record carries.
"""
