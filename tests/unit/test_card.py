"""Model cards (runtime.model.card): op sizes against hand-computed FLOPs and bytes for one
layer of DeepSeek-V3, the card substitution of a capture's ops and messages, and the toy
model's ops recorded by a capture pod's forward."""

from __future__ import annotations

import pytest

from runtime.model import ModelConfig
from runtime.model.card import CARDS, apply_card, card_of, op_size, structure

V3 = CARDS["deepseek-v3"]


def test_one_deepseek_v3_layer_by_hand():
    n = 96
    # MLA prolog: W_DQ 7168x1536, W_UQ|W_QR 1536x(128x192), W_DKV|W_KR 7168x576, absorbed
    # W_UK 128x128x512: INT8 weights, BF16 activations
    w = 7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 128 * 128 * 512
    f, rd, wr, unit, dtype = op_size(V3, "mla_prolog", {"rows": n})
    assert (f, rd, unit, dtype) == (2 * n * w, w + n * 7168 * 2, "aic", "int8")
    assert wr == n * 128 * 576 * 2 + n * 576 * 2
    # the attention core over a 4,096-token context: QK over 576 dims, PV over 512, per head
    f, rd, wr, unit, dtype = op_size(V3, "mla", {"rows": n, "ctx": [4096] * n,
                                                 "req_ctx": [4096] * n})  # fmt: skip
    assert f == n * 2 * 128 * 4096 * (576 + 512) and dtype == "bf16"
    assert rd == n * 4096 * 576 * 2 + n * 128 * 576 * 2 and wr == n * 128 * 512 * 2
    # routed experts: 3 x 7168 x 2048 INT8 weights each, read once per expert with rows
    f, rd, wr, _, _ = op_size(V3, "experts", {"counts": [700, 0, 68]})
    we = 3 * 7168 * 2048
    assert f == 2 * 768 * we and rd == 2 * we + 768 * 7168 * 2 and wr == 768 * 7168 * 2
    f, rd, _, _, _ = op_size(V3, "lm_head", {"rows": 2})
    assert f == 2 * 2 * 7168 * 129280 and rd == 7168 * 129280 + 2 * 7168 * 2
    with pytest.raises(ValueError, match="not a model op"):
        op_size(V3, "nosuch", {})


def test_apply_card_resizes_ops_messages_and_context():
    toy = card_of(ModelConfig())
    dims = {"rows": 2, "ctx": [5, 6], "offsets": [1, 2], "req_ctx": [6], "req_span": [2]}
    f, rd, wr, unit, dtype = op_size(toy, "mla", dims)
    events = [
        ["op", 0, 0, 0, "mla", f, rd, wr, {**dims, "unit": unit, "dtype": dtype}],
        ["put", 1, 0, 0, 3, 2 * 1152, "fused_disp", 2, 2, 1152],
        ["put", 1, 0, 0, 3, 2 * 1024, "fused_comb", 2, 2, 1024],
        ["put", 1, 0, 0, 3, 64, "app", 0, 0, 0],
        ["op", 1, 0, 0, "quantize", 3 * 2 * 256, 2 * 2 * 256, 2 * 256 + 8, {"rows": 2,
                                                                           "hidden": 256}],
    ]  # fmt: skip
    out = apply_card(events, V3, context=4096)
    mla = out[0]
    assert mla[8]["ctx"] == [4097, 4098] and mla[8]["req_ctx"] == [4098]
    assert mla[5] == op_size(V3, "mla", mla[8])[0] and mla[8]["dtype"] == "bf16"
    assert out[1][5] == 2 * (7168 + 512) and out[1][9] == 7168 + 512
    assert out[2][5] == 2 * 14336 and out[3] == events[3]
    assert out[4][5] == pytest.approx(3 * 2 * 7168)  # the all-to-all op at the card's width


def test_structure_gives_the_toy_the_cards_layers_and_routing():
    over = structure(V3)
    assert over == {"n_layers": 61, "n_dense_layers": 3, "num_experts": 256, "topk": 8,
                    "n_group": 8, "topk_group": 4}  # fmt: skip
    cfg = ModelConfig.preset("tiny", **over)
    assert cfg.n_layers == 61 and cfg.hidden == 64
