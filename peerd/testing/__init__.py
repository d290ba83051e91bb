"""The test harness: real local swarms (:mod:`peerd.testing.localswarm`), the standalone averaging peer
(:mod:`peerd.testing.avgpeer`) and fault injection (:mod:`peerd.testing.faults`). Used by the tests, the demo and the
benchmarks; production code never imports it (a test hands the daemon the fault wrappers by name through the
context hook, ``PEERD_CONTEXT_HOOK``: :meth:`peerd.testing.faults.Faults.environ`)."""
