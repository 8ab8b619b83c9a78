"""The options of `xpod decode` (`DecodeOptions`), shared by the run and its report."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from runtime.model import EPLBConfig

MAX_BATCH = 1 << 20  # --batch: requests of one run
EPLB_MODES = ("off", "on", "compare")


@dataclass
class DecodeOptions:
    dies: int = 4
    batch: int = 8
    prompt_len: int = 64
    steps: int = 32
    model: str = "small"
    quant: str | None = None
    combine_dtype: str = "bfloat16"
    protocol: str = "fused"
    temperature: float = 0.0
    seed: int = 0
    check: bool = False
    repeat: int = 1  # pod runs (with check: each followed by the one-process baseline)
    trace: str | None = None
    json: str | None = None
    block_size: int = 16
    timeout_s: float = 120.0
    overrides: dict = field(default_factory=dict)
    prompts: list[list[int]] | None = None  # explicit prompts (then batch = len(prompts))
    pin: str = "auto"
    wait: str = "auto"
    cores: int = 0  # CPU cores the pod may use (0: the machine's)
    eplb: str = "off"  # off | on | compare (both runs, same prompts)
    eplb_config: EPLBConfig = field(default_factory=EPLBConfig)
    # MoE-attention disaggregation: 0 attention dies = colocated (every die does both)
    attention_dies: int = 0
    expert_dies: int = 0
    domains: int = 1
    microbatches: int = 1
    # pods over hosts (docs/protocols.md §11): the host of every die, the fabric between them
    hosts: tuple = ()
    fabric: str = "auto"
    host_names: tuple = ()
    net_if: str = ""
    spec: object = None  # runtime.model.mtp.SpecConfig: MTP speculative decoding, or None
    # --project (runtime.decode.project): a profile name or path, the model card, the uniform
    # context, the projected trace, where to keep the captures, the capture's decode steps
    project: str | None = None
    model_card: str | None = None
    context: int | None = None
    project_trace: str | None = None
    project_dir: str | None = None
    project_steps: int = 3

    @property
    def split(self) -> bool:
        return self.attention_dies > 0


def progress(msg: str) -> None:
    """A progress line of a decode run (stderr: stdout holds the report)."""
    print(msg, file=sys.stderr, flush=True)
