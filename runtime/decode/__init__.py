"""`xpod decode`: the raw fixed-batch decode loop of the toy model over a pod (`run`), its
options (`options`) and its report against the single-process reference (`report`). The
baseline the serving engine is measured against. Imports the model and the pod, never the
engine."""

from runtime.decode.options import EPLB_MODES, MAX_BATCH, DecodeOptions
from runtime.decode.run import DecodeSpec, decode_main, make_prompts, pod_config, run_decode, spread

__all__ = [
    "EPLB_MODES",
    "MAX_BATCH",
    "DecodeOptions",
    "DecodeSpec",
    "decode_main",
    "make_prompts",
    "pod_config",
    "run_decode",
    "spread",
]
