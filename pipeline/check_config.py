"""The runtime check's options (pipeline/check.py), in a module of their own: pipeline/config.py composes them into
RunConfig and pipeline/check.py runs them, and neither imports the other for them (no import circle)."""
from dataclasses import dataclass, field

from pipeline.errors import UserError


@dataclass
class CheckConfig:
    """The runtime check after export (pipeline/check.py): Triton kernel vs oracle on real K/V."""
    enabled: bool = True
    contexts: list[int] = field(default_factory=lambda: [64, 200])   # CPU: the kernels run in Triton's interpreter
    batches: list[int] = field(default_factory=lambda: [1, 2])
    gpu_contexts: list[int] = field(default_factory=lambda: [64, 200, 1024, 4096])  # used instead on a GPU
    # the quality canary (runtime_check/canary.py): scored tokens of model-sampled text served through the
    # artifact's cache vs full precision and vs a calibration-free baseline; 0 turns it off
    canary_tokens: int = 128
    # the canary's absolute limits (runtime_check/canary.py MAX_KL, MIN_TOP1): KL(model || served) in nats and top-1
    # agreement with the model's own forward; a user may tighten or loosen them, the artifact cannot
    max_kl: float = 0.25
    min_top1: float = 0.75
    # an artifact that records no canary of its run (check.enabled=false, canary_tokens=0, or a claim removed) is
    # judged on the limits alone only when the user says so; the verdict prints it
    allow_unclaimed: bool = False
    # judge an artifact on another model than the one it was calibrated for (same shapes and tokenizer, other
    # weights): a deliberate transfer, printed in the verdict; the claims are then shown, not judged
    allow_other_model: bool = False


def validate_check_options(contexts: list[int], batches: list[int], max_context: int | None,
                           canary_tokens: int = 0, max_kl: float = 0.25, min_top1: float = 0.75) -> None:
    """The check's contexts and batch sizes; max_context: the model's positions less the prefix (None: not known yet, check the lower bounds only)."""
    if not contexts or not batches:
        raise UserError(f"check.contexts and check.batches must be non-empty, got {contexts} and {batches}")
    for t in contexts:
        if t < 1 or (max_context is not None and t >= max_context):
            upper = "" if max_context is None else f", {max_context - 1}"
            raise UserError(f"check.contexts: each context must be in [1{upper}] (at most the model's positions less "
                            f"the prefix and the decoded token), got {t}")
    for b in batches:
        if b < 1:
            raise UserError(f"check.batches: each batch size must be >= 1, got {b}")
    if canary_tokens < 0:
        raise UserError(f"check.canary_tokens: allowed an integer >= 0 (0: no quality canary), got {canary_tokens}")
    if not 0 <= max_kl < float("inf"):  # NaN fails too
        raise UserError(f"check.max_kl: allowed a number of nats >= 0 (KL of the served logits from the model's), "
                        f"got {max_kl}")
    if not 0 <= min_top1 <= 1:
        raise UserError(f"check.min_top1: allowed a fraction in [0, 1] (top-1 agreement with the model), "
                        f"got {min_top1}")
