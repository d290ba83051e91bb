"""The training worker every training role builds on.

- :mod:`peerd.worker.core`: :class:`WorkerCore`, the lifecycle every training role shares (set-up, the train/round
  loop, pause, evaluation, status and "left" records, leaving).
- :mod:`peerd.worker.stats`: :class:`RoundStats`, the counters a worker reports.
- The DiLoCo worker (:mod:`peerd.worker.outer_worker`) adds the inner loop (:mod:`peerd.worker.inner`), catch-up
  (:mod:`peerd.worker.catch_up`), its checkpoint (:mod:`peerd.worker.checkpointing`), the round evaluation
  (:mod:`peerd.worker.evaluation`) and one round strategy (:mod:`peerd.worker.rounds`).
- How this machine computes an inner step: :mod:`peerd.worker.inner_step` (micro-batches, precision) and
  :mod:`peerd.worker.local_dp` (several devices of one machine as one peer).
- :mod:`peerd.worker.checkpoint_file`: the checkpoint file format every training role writes;
  :mod:`peerd.worker.preflight`: what ``peerd join`` checks (node options, local checkpoint) before the network.
"""
