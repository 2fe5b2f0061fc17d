"""The NextN block from transformers' modules (runtime/nextn.py) and its calibration stage."""
from __future__ import annotations

import torch

from mixq.formats.checkpoint import open_checkpoint
from mixq.runtime.calibration import LayerCalibrator
from mixq.runtime.layer_stream import DecoderStream
from mixq.runtime.nextn import build_nextn


def test_block_holds_every_nextn_tensor(mini_model):
    """Every tensor of the checkpoint's NextN block is read into the block, nothing else is."""
    ck = open_checkpoint(mini_model)
    n = ck.nextn_layers[0]
    read: list[str] = []

    def fetch(name):
        read.append(name)
        return ck.get(name)

    build_nextn(DecoderStream(ck.config).text_config, n, fetch)
    want = {x for x in ck.names() if x.startswith(f"model.language_model.layers.{n}.")}
    assert sorted(read) == sorted(want)


def test_eh_proj_statistics_are_the_models_nextn_inputs(mini_model):
    """The NextN stage's eh_proj input is [enorm(embedding of token t+1) | hnorm(h[t])] with h transformers'
    own last_hidden_state of the whole text model: its Σx² equals that computed from the reference forward."""
    from mixq.runtime.reference import build_model

    ck = open_checkpoint(mini_model)
    ids = torch.randint(0, int(ck.text_config["vocab_size"]), (2, 12), generator=torch.Generator().manual_seed(0))
    stages = list(LayerCalibrator(ck, ids, full=False, nextn=True).stages())
    assert [s.layer for s in stages] == [0, 1, 2, 3, None, 4]
    acc = stages[-1].stats["model.language_model.layers.4.eh_proj.weight"]

    weights = {name: ck.get(name) for name in ck.names()}
    model = build_model(mini_model, weights, torch.device("cpu"))
    with torch.no_grad():
        h = model.model.language_model(input_ids=ids).last_hidden_state
        e = model.model.language_model.embed_tokens(ids)

    def rms(x, w):
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + float(ck.text_config["rms_norm_eps"])) * w

    p = "model.language_model.layers.4."
    x = torch.cat([rms(e[:, 1:], weights[p + "enorm.weight"]), rms(h[:, :-1], weights[p + "hnorm.weight"])], -1)
    assert acc.count == 2 * 11
    torch.testing.assert_close(acc.sum_sq.float(), x.square().sum((0, 1)), rtol=1e-4, atol=1e-5)
