"""The ``peerd`` command line: :mod:`peerd.commands.main` (the entry point and exit codes), :mod:`~.parser` (every
command and flag) and one module per group of commands (:mod:`~.serve`, :mod:`~.status`, :mod:`~.control`,
:mod:`~.node`, :mod:`~.model`), with the tools they run (:mod:`~.doctor`, :mod:`~.export`, :mod:`~.generate`,
:mod:`~.swarm_infer`). Nothing else imports this package."""
