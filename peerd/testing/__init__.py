"""The test harness: real local swarms (:mod:`peerd.testing.localswarm`), the standalone averaging peer
(:mod:`peerd.testing.avgpeer`) and fault injection (:mod:`peerd.testing.faults`). Used by the tests, the demo and the
benchmarks; production code never imports it (the daemon loads the fault wrappers only when ``PEERD_FAULTS`` is
set)."""
