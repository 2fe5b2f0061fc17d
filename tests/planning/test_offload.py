"""`mixq plan --fit --gpu --cpu` (planning/offload.py): llama.cpp's expert offload planned on GLM-5.3-Flash's shapes.

Oracles: each tensor's bytes from its shape and type (formats/gguf_layout), the host side selected by the -ot regex
written here, each card's layers from the printed -ts as whole layer counts, the cache per layer from the config's
numbers and llama.cpp's cache rows (docs/memory-model.md §1); never the planner's own per-device totals.
"""
from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

from mixq.cli import main
from mixq.errors import InputError, PlanError
from mixq.formats.checkpoint import checkpoint_from_config, open_checkpoint
from mixq.formats import gguf_layout
from mixq.measurement.options import PlanOptions
from mixq.planning.gguf import predicted_error
from mixq.planning.offload import layer_devices, offload_plan
from mixq.planning.sizes import parse_card_sizes

OT = r"blk\.[0-9]+\.ffn_(gate|up|down)_exps\.weight"


def _cache_per_layer(cfg: dict, context: int) -> dict[int, int]:
    """f16 cache bytes of each trunk layer, one sequence: DSA layers the MLA latent (r + rope) and the indexer keys
    (3 * index_head_dim), KDA layers the F32 state d*d*H and conv 3*(c-1)*H*d; cells = context rounded up to 256."""
    t = cfg["text_config"]
    cells = -(-context // 256) * 256
    lac = t["linear_attn_config"]
    h, d, c = lac["num_heads"], lac["head_dim"], lac["short_conv_kernel_size"]
    out = {}
    for i, kind in enumerate(t["layer_types"][:t["num_hidden_layers"]]):
        if kind == "linear_attention":
            out[i] = 4 * (d * d * h + 3 * (c - 1) * h * d)
        else:
            out[i] = cells * 2 * (t["kv_lora_rank"] + (t.get("qk_rope_head_dim") or 0) + 3 * t["index_head_dim"])
    return out


@pytest.fixture(scope="module")
def flash(flash_config):
    return checkpoint_from_config(flash_config)


@pytest.fixture(scope="module")
def glm53_offload(flash):
    """What `mixq plan --from-config CFG --format gguf --fit --gpu 2x24GB --cpu 128GB --context 204800 --json`
    prints (the command prints this dict)."""
    return json.loads(json.dumps(offload_plan(flash, gpu="2x24GB", cpu="128GB", context=204800).to_dict()))


def test_glm53_2x24gb_128gb_each_device_holds_its_bytes(glm53_offload, flash_config):
    d = glm53_offload
    cfg = json.loads(flash_config.read_text())
    tensors = d["plan"]["tensors"]
    nbytes = {t["name"]: gguf_layout.tensor_bytes(t["type"], t["shape"]) for t in tensors}
    host = [t["name"] for t in tensors if re.search(OT, t["name"]) or t["name"] == "token_embd.weight"]
    assert {t["name"] for t in tensors if t["role"] == "routed_expert"} <= set(host)
    dev = {x["device"]: x for x in d["devices"]}
    assert list(dev) == ["CUDA0", "CUDA1", "CPU"]
    host_bytes = sum(nbytes[n] for n in host)
    assert dev["CPU"]["weights_bytes"] == host_bytes
    assert host_bytes + 4 * 10**9 <= 128 * 10**9  # the experts fit the host budget, its 4 GB reserve included

    flags = d["flags"]
    assert flags[:4] == ["-ngl", "999", "-c", "204800"]
    assert flags[flags.index("-ot") + 1] == OT + "=CPU"
    ts = [int(x) for x in flags[flags.index("-ts") + 1].split(",")]
    n_all = cfg["text_config"]["num_hidden_layers"] + cfg["text_config"]["num_nextn_predict_layers"]
    assert sum(ts) == n_all + 1  # every layer and the output layer
    card_of = [k for k, n in enumerate(ts) for _ in range(n)]
    kv = _cache_per_layer(cfg, 204800)
    for k in range(2):
        layers = {il for il, c in enumerate(card_of) if c == k}
        weights = sum(b for n, b in nbytes.items() if n not in host and (
            int(m.group(1)) if (m := re.match(r"blk\.(\d+)\.", n)) else n_all) in layers)
        cache = sum(kv.get(il, 0) for il in layers)
        card = dev[f"CUDA{k}"]
        assert (card["weights_bytes"], card["cache_bytes"], card["reserve_bytes"]) == (weights, cache, 2 * 10**9)
        assert weights + cache + 2 * 10**9 <= 24 * 10**9
    assert sum(dev[f"CUDA{k}"]["cache_bytes"] for k in range(2)) == d["cache_bytes"]


def test_impossible_host_budget_names_the_host(flash):
    with pytest.raises(PlanError, match=r"^--cpu 64\.000 GB less --cpu-reserve 4\.000 GB .* too small: the lowest "
                                        r"possible plan needs"):
        offload_plan(flash, gpu="2x24GB", cpu="64GB", context=204800)


def test_impossible_budget_is_one_error_line_exit_2(k256_model):
    r = CliRunner().invoke(main, ["plan", str(k256_model), "--format", "gguf", "--fit", "--gpu", "2x8MB", "--cpu",
                                  "6MB", "--context", "4096", "--reserve", "1MB", "--cpu-reserve", "1MB"])
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mixq: error: --cpu 0.006 GB"), r.output


@pytest.mark.parametrize("kw,msg", [
    (dict(fmt="exl3", fit="offload", gpu="2x24GB", cpu="128GB", context=4096), "exllamav3 has no expert offload"),
    (dict(fmt="gguf", gpu="2x24GB", context=4096), "--gpu and --cpu go together"),
    (dict(fmt="gguf", fit="100GB", gpu="2x24GB", cpu="128GB", context=4096), "two machines"),
    (dict(fmt="gguf", fit="offload", context=4096), "--fit without a size"),
    (dict(fmt="gguf", gpu="2x24GB", cpu="128GB", context=4096, n_cpu_moe="x"), "--n-cpu-moe 'x'"),
    (dict(fmt="gguf", gpu="2x24GB", cpu="128GB", context=4096, measure="kld"), "--measure curves are not used"),
])
def test_offload_options_refused_in_one_line(kw, msg):
    with pytest.raises(InputError, match=re.escape(msg)):
        PlanOptions(**kw)


def test_cli_refuses_cpu_for_exl3(k256_model):
    r = CliRunner().invoke(main, ["plan", str(k256_model), "--format", "exl3", "--fit", "--gpu", "24GB", "--cpu",
                                  "128GB", "--context", "4096"])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "exllamav3 has no expert offload" in r.output


def test_n_cpu_moe_keeps_the_first_layers_experts_on_the_host(k256_model):
    ckpt = open_checkpoint(k256_model)
    res = offload_plan(ckpt, gpu="2x20MB", cpu="20MB", context=4096, reserve=0, cpu_reserve=0, n_cpu_moe=2)
    host = res.devices[-1]
    on_host = {t.name for t in res.plan.tensors if (m := re.match(r"blk\.(\d+)\.ffn_\w+_exps", t.name))
               and int(m.group(1)) < 2} | {"token_embd.weight"}
    assert host.weights == sum(gguf_layout.tensor_bytes(t.type, t.shape) for t in res.plan.tensors
                               if t.name in on_host)
    assert "--n-cpu-moe" in res.flags() and res.flags()[res.flags().index("--n-cpu-moe") + 1] == "2"
    assert "-ot" not in res.flags()


@pytest.mark.parametrize("n_all", [5, 46, 92])
def test_whole_layer_counts_as_ts_give_exactly_those_layers(n_all):
    for a in range(n_all + 2):
        assert layer_devices((a, n_all + 1 - a), n_all) == [0] * a + [1] * (n_all + 1 - a)
    if n_all > 30:
        assert layer_devices((10, 20, n_all - 29), n_all) == [0] * 10 + [1] * 20 + [2] * (n_all - 29)


def test_card_sizes():
    assert parse_card_sizes("--gpu", "2x24GB") == (24 * 10**9,) * 2
    assert parse_card_sizes("--gpu", "24GB,16GiB") == (24 * 10**9, 16 * 2**30)
    for bad in ("0x24GB", "2x", ",", "24GB,,8GB"):
        with pytest.raises(InputError, match="--gpu"):
            parse_card_sizes("--gpu", bad)


def test_n_cpu_moe_auto_is_the_least_error_of_every_count(k256_model):
    ckpt = open_checkpoint(k256_model)
    machine = dict(gpu="2x9MB", cpu="9MB", context=4096, reserve=0, cpu_reserve=0)
    auto = offload_plan(ckpt, n_cpu_moe="auto", **machine)
    n_all = ckpt.num_hidden_layers + len(ckpt.nextn_layers)
    errors = {}
    for n in range(n_all + 1):
        try:
            errors[n] = predicted_error(offload_plan(ckpt, n_cpu_moe=n, **machine).plan)
        except PlanError:
            continue
    assert len(errors) > 1 and predicted_error(auto.plan) == min(errors.values())
    best = min(n for n, e in errors.items() if e == min(errors.values()))
    assert auto.n_cpu_moe == (None if best == n_all else best)


def test_cards_too_small_for_the_cache_name_the_cards(k256_model):
    with pytest.raises(PlanError, match=r"^--gpu 0\.002 GB less cache .* leave nothing for the weights"):
        offload_plan(open_checkpoint(k256_model), gpu="2x1MB", cpu="1GB", context=4096, reserve="1MB")


def test_api_keywords_plan_the_offload(k256_model):
    import mixq

    res = mixq.plan(k256_model, "gguf", gpu="2x20MB", cpu="20MB", context="4K", reserve="1MB", cpu_reserve="1MB",
                    n_cpu_moe="all")
    assert [d.name for d in res.devices] == ["CUDA0", "CUDA1", "CPU"] and res.n_cpu_moe is None
    assert res.flags()[res.flags().index("-c") + 1] == "4096" and all(d.headroom >= 0 for d in res.devices)


def test_unequal_cards_each_hold_their_layers(k256_model):
    res = offload_plan(open_checkpoint(k256_model), gpu="9MB,5MB", cpu="20MB", context=4096, reserve="1MB",
                       cpu_reserve=0)
    flags = res.flags()
    ts = [int(x) for x in flags[flags.index("-ts") + 1].split(",")]
    card_of = [k for k, n in enumerate(ts) for _ in range(n)]
    n_all = len(card_of) - 1
    for k, cap in enumerate((9 * 10**6, 5 * 10**6)):
        weights = sum(gguf_layout.tensor_bytes(t.type, t.shape) for t in res.plan.tensors
                      if not re.search(OT, t.name) and t.name != "token_embd.weight"
                      and card_of[int(m.group(1)) if (m := re.match(r"blk\.(\d+)\.", t.name)) else n_all] == k)
        assert res.devices[k].weights == weights
        assert weights + res.devices[k].cache + 500_000 <= cap


def test_cli_prints_the_devices_and_flags(k256_model):
    args = ["plan", str(k256_model), "--format", "gguf", "--fit", "--gpu", "9MB,5MB", "--cpu", "20MB", "--context",
            "4096", "--reserve", "1MB", "--cpu-reserve", "0"]
    r = CliRunner().invoke(main, args + ["--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert [x["device"] for x in d["devices"]] == ["CUDA0", "CUDA1", "CPU"]
    assert d["flags"][d["flags"].index("-ot") + 1] == OT + "=CPU"
    text = CliRunner().invoke(main, args).output
    assert "CUDA1" in text and f"llama.cpp: {d['command']}" in text
