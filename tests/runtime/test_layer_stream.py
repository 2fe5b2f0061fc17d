"""runtime/layer_stream.py: one decoder layer's tensors assembled from checkpoint names, and written back in place
(what block-output tuning hands a step: only the tensors its stage moves)."""
from __future__ import annotations

import pytest
import torch

from mixq.formats.checkpoint import open_checkpoint
from mixq.runtime.layer_stream import (DecoderStream, layer_params, module_sources, stacked_block, stacked_parts,
                                       stacked_rows, write_values)

LAYER = 1  # a MoE layer of the mini fixture (16 routed experts)
P = f"model.language_model.layers.{LAYER}.mlp"


def layer_state_dict(module, layer: int, fetch) -> dict[str, torch.Tensor]:
    """The reference the module's tensors are checked against: its state dict assembled from checkpoint tensors
    (fetch: HF name -> tensor), each row's parts concatenated on dim 0, a routed-expert tensor's rows stacked."""
    sd: dict[str, torch.Tensor] = {}
    for key, ref in module.state_dict(keep_vars=True).items():
        rows = [torch.cat([fetch(n) for n in parts], 0)
                for parts in module_sources(layer, key, ref.shape[0] if ref.dim() else 0)]
        sd[key] = (torch.stack(rows) if len(rows) > 1 else rows[0]).reshape(ref.shape)
    return sd


def _layer(mini_model):
    ck = open_checkpoint(mini_model)
    stream = DecoderStream(ck.config)
    mod = stream.materialize(LAYER, lambda n: ck.get(n, dtype=torch.float32))
    return ck, mod.requires_grad_(False)


def test_layer_params_are_the_state_dict_entries_that_hold_the_values(mini_model):
    """Only the entries holding a moved tensor; each equal to the state dict assembled from the same values; a
    stacked one is the module's own tensor with the moved rows written in, and its gradient reaches the moved
    tensors only."""
    ck, mod = _layer(mini_model)
    fetch = lambda n: ck.get(n, dtype=torch.float32)  # noqa: E731
    up3 = f"{P}.experts.3.up_proj.weight"
    moved = {up3: torch.randn(ck.shape(up3), requires_grad=True),
             f"{P}.shared_experts.down_proj.weight": torch.randn(ck.shape(f"{P}.shared_experts.down_proj.weight"))}
    want = layer_state_dict(mod, LAYER, lambda n: moved[n] if n in moved else fetch(n))
    got = layer_params(mod, LAYER, moved, fetch)
    assert set(got) == {"mlp.experts.gate_up_proj", "mlp.shared_experts.down_proj.weight"}
    for k, v in got.items():
        assert torch.equal(v, want[k]), k
    gu = got["mlp.experts.gate_up_proj"]
    assert gu.data_ptr() == mod.mlp.experts.gate_up_proj.data_ptr()  # no copy of the stack
    (gu * torch.arange(gu.numel(), dtype=gu.dtype).reshape(gu.shape)).sum().backward()
    inter = ck.shape(up3)[0]
    expected = torch.arange(gu.numel(), dtype=gu.dtype).reshape(gu.shape)[3, inter:]
    assert torch.equal(moved[up3].grad, expected)


def test_materialize_fills_every_tensor_as_the_state_dict_assembles_it(mini_model):
    """A layer materialised tensor by tensor holds exactly the state dict assembled from the checkpoint (stacked
    experts, their gate and up halves, and every other tensor)."""
    ck, mod = _layer(mini_model)
    sd = layer_state_dict(mod, LAYER, lambda n: ck.get(n, dtype=torch.float32))
    assert set(sd) == set(mod.state_dict())
    assert all(torch.equal(v, mod.state_dict()[k]) for k, v in sd.items())


def test_stacked_parts_are_views_of_the_experts_in_the_module(mini_model):
    """Every routed expert's checkpoint tensor has a view into the module's stacks holding exactly it (the gate
    and up halves of a gate_up row apart); writing through a view writes the module; nothing else is listed."""
    ck, mod = _layer(mini_model)
    parts = stacked_parts(mod, LAYER, ck.shape)
    experts = int(mod.mlp.experts.down_proj.shape[0])
    assert set(parts) == {f"{P}.experts.{e}.{k}_proj.weight" for e in range(experts) for k in ("gate", "up", "down")}
    for n, v in parts.items():
        assert torch.equal(v, ck.get(n, dtype=torch.float32)), n
    up = parts[f"{P}.experts.2.up_proj.weight"]
    up.copy_(torch.full_like(up, 7.0))
    inter = ck.shape(f"{P}.experts.2.gate_proj.weight")[0]
    assert bool((mod.mlp.experts.gate_up_proj[2, inter:] == 7.0).all())
    assert torch.equal(mod.mlp.experts.gate_up_proj[2, :inter], ck.get(f"{P}.experts.2.gate_proj.weight"))


def test_stacked_block_is_stacked_rows_from_whole_stacks(mini_model):
    """Rows of the experts' stacks built from whole stacks (gate and up of experts 4-9) equal the row-by-row build;
    the gradient reaches each stack whole; a part missing from the stacks falls back to the rows (from fetch)."""
    ck, mod = _layer(mini_model)
    fetch = lambda n: ck.get(n, dtype=torch.float32)  # noqa: E731
    rows = range(4, 10)
    names = {k: tuple(f"{P}.experts.{e}.{k}_proj.weight" for e in rows) for k in ("gate", "up", "down")}
    stacks = {v: torch.randn(len(rows), *ck.shape(v[0]), requires_grad=True) for v in names.values()}
    per_row = {n: t[i] for v, t in stacks.items() for i, n in enumerate(v)}
    for key in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
        got = stacked_block(mod, LAYER, key, rows, stacks, fetch)
        assert torch.equal(got, stacked_rows(mod, LAYER, key, rows, per_row, fetch)), key
    gu = stacked_block(mod, LAYER, "mlp.experts.gate_up_proj", rows, stacks, fetch)
    (gu * 2).sum().backward()
    assert torch.equal(stacks[names["gate"]].grad, torch.full_like(stacks[names["gate"]], 2.0))
    only_gate = {names["gate"]: stacks[names["gate"]].detach()}
    got = stacked_block(mod, LAYER, "mlp.experts.gate_up_proj", rows, only_gate, fetch)
    inter = ck.shape(names["gate"][0])[0]
    assert torch.equal(got[:, :inter], only_gate[names["gate"]])
    assert torch.equal(got[:, inter:], torch.stack([fetch(n) for n in names["up"]]))


def test_write_values_copies_rows_in_place(mini_model):
    ck, mod = _layer(mini_model)
    fetch = lambda n: ck.get(n, dtype=torch.float32)  # noqa: E731
    param = mod.mlp.experts.down_proj
    ptr, before = param.data_ptr(), param.detach().clone()
    new = {f"{P}.experts.5.down_proj.weight": torch.randn(ck.shape(f"{P}.experts.5.down_proj.weight")),
           f"{P}.experts.7.gate_proj.weight": torch.randn(ck.shape(f"{P}.experts.7.gate_proj.weight"))}
    write_values(mod, LAYER, new, fetch)
    assert param.data_ptr() == ptr  # in place
    assert torch.equal(param[5], new[f"{P}.experts.5.down_proj.weight"])
    assert torch.equal(param[4], before[4]) and torch.equal(param[6], before[6])
    gu = mod.mlp.experts.gate_up_proj[7]
    inter = ck.shape(f"{P}.experts.7.gate_proj.weight")[0]
    assert torch.equal(gu[:inter], new[f"{P}.experts.7.gate_proj.weight"])
    assert torch.equal(gu[inter:], fetch(f"{P}.experts.7.up_proj.weight"))  # the row's other part from fetch
    sd = layer_state_dict(mod, LAYER, lambda n: new[n] if n in new else fetch(n))
    assert all(torch.equal(v, mod.state_dict()[k]) for k, v in sd.items())


def test_run_layer_streams_land_in_one_host_tensor(mini_model):
    """The layer's output streams, batch by batch, in one host tensor: the same values as the whole batch at once."""
    ck, mod = _layer(mini_model)
    stream = DecoderStream(ck.config, batch_rows=2)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 8, stream.hc_mult, int(ck.text_config["hidden_size"]), generator=g)
    out, topk = stream.run_layer(mod, hidden, None)
    whole, _ = DecoderStream(ck.config, batch_rows=5).run_layer(mod, hidden, None)
    assert out.shape == hidden.shape and out.device.type == "cpu" and topk is None
    torch.testing.assert_close(out, whole, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_run_layer_on_cuda_returns_pinned_streams(mini_model):
    ck = open_checkpoint(mini_model)
    stream = DecoderStream(ck.config, device="cuda", batch_rows=2)
    mod = stream.materialize(LAYER, lambda n: ck.get(n, dtype=torch.float32))
    hidden = torch.randn(5, 8, stream.hc_mult, int(ck.text_config["hidden_size"]))
    out, _ = stream.run_layer(mod, hidden, None)
    ref = torch.cat([stream.forward_batch(mod, hidden[sl].cuda(), None)[0].cpu() for sl in stream.batches(5)])
    assert out.is_pinned() and torch.equal(out, ref)
