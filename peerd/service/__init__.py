"""What a volunteer's machine needs around a role: control socket, pause gate, active hours, health, systemd
notify protocol, resource limits, Prometheus metrics, and :mod:`peerd.service.volunteer`, which wires them."""
