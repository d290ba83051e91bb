"""A SWARM pipeline stage served to peers, and the trainer's side that pushes micro-batches through the stages.

Source: SWARM parallelism (Ryabinin et al. 2023, arXiv 2301.11913): each stage is served by several peers; a
trainer sends every micro-batch forward through one server per stage (chosen by :class:`protocols.swarm.Wiring`)
and the activation gradients back through the same servers.

Methods of :class:`StageService` (on :mod:`protocols.rpc`; tensors encoded by :mod:`protocols.codecs`):

- ``forward`` (not on the last stage): header ``{"mb": id, "x": tensor header}`` (stage 0: ``"tokens"``: a
  token header, see :func:`encode_tokens`), payload = the input; reply ``{"y": tensor header}`` + the output
  activations (B, T, C). The server keeps the input for the micro-batch's backward (bounded: ``max_pending``
  micro-batches, each for at most ``pending_timeout_s``; more are refused with code ``"busy"``: back-pressure).
- ``backward``: header ``{"mb": id, "g": tensor header}``, payload = the gradient of the loss w.r.t. this stage's
  output (B, T, C); the server recomputes its forward from the kept input (so it keeps one tensor per micro-batch,
  not an autograd graph, and an optimizer step between forward and backward is harmless), accumulates its
  parameters' gradients and replies ``{"g": tensor header}`` + the gradient w.r.t. its input (stage 0: nothing).
- ``loss`` (last stage only): header ``{"mb": id, "x": tensor header, "x_bytes": n, "targets": token header}``,
  payload = the activations then the targets; forward and backward at once; reply ``{"loss": float, "g": tensor
  header}`` + the gradient w.r.t. the activations.

- ``infer``: forward only, nothing kept and no gradient (evaluation, generation): header as ``forward`` (not on
  the last stage), reply ``{"y": tensor header}`` + the output activations; on the last stage header ``{"mb": id,
  "x": tensor header, "x_bytes": n}`` plus ``"targets": token header`` (payload = activations then targets) for a
  reply ``{"loss": float}``, or without targets (payload = activations) for a reply ``{"logits": tensor header}`` +
  the next-token logits at the last position (B, V).
- ``state``: no payload; reply ``{"params": tensor header, "steps": int}`` + this stage's parameters, flattened
  in ``named_parameters()`` order, fp32 without compression (a server that moves to this stage starts from them).
- ``outer``: no payload; reply ``{"outer": tensor header, "outer_round": int}`` + the stage's outer state (2, N)
  fp32 (theta_outer, outer momentum) of the replicas' outer rounds; refused (``no-outer``) by a server that does
  not average (a mover or a replica that fell behind adopts it).

Peer input is untrusted: sizes are checked before reading, shapes against the model, values must be finite (a NaN
activation is a :class:`ProtocolViolation`), and the sender is banned. A trainer treats a server's non-finite
reply the same way (ban, retry the micro-batch on another server of the stage).

The package: :mod:`~protocols.stage_service.server` (:class:`StageService`), :mod:`~protocols.stage_service.trainer`
(:class:`PipelineTrainer` and its spot-checks), :mod:`~protocols.stage_service.messages` (token ids and the
fields of a stage call) and :mod:`~protocols.stage_service.parameters` (a stage's parameters and outer state, here
and from a peer).
"""

from protocols.stage_service.messages import decode_tokens, encode_tokens
from protocols.stage_service.parameters import (
    download_outer_state, download_stage_parameters, flat_parameters, load_flat_parameters,
)
from protocols.stage_service.server import StageService
from protocols.stage_service.trainer import PipelineTrainer, outputs_agree

__all__ = [
    "PipelineTrainer", "StageService", "decode_tokens", "download_outer_state", "download_stage_parameters",
    "encode_tokens",
    "flat_parameters", "load_flat_parameters", "outputs_agree",
]
