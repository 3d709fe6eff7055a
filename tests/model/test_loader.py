"""Tests for specmla.model.loader: HF checkpoint directories → DeepseekForCausalLM, MTP layers,
error reporting, save_checkpoint round-trips (incl. transformers reading our files), dtypes.

CPU, fp32, tiny random models from tests/helpers/hf_models.py; checkpoints are written once per module and
copied into each test's tmp_path before being damaged.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from specmla.config import UnsupportedModelError
from specmla.model.deepseek import MTPLayer
from specmla.model.loader import CheckpointError, load_model, save_checkpoint
from specmla.model.metadata import AttentionMetadata
from helpers.hf_models import CONFIGS, build_hf_model, save_hf_model

INDEX = "model.safetensors.index.json"


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def _weight_map(path: Path) -> dict[str, str]:
    with open(path / INDEX) as f:
        return json.load(f)["weight_map"]


def _read_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory, read straight from the safetensors files."""
    path = Path(path)
    if (path / INDEX).exists():
        files: dict[str, list[str]] = {}
        for name, fname in _weight_map(path).items():
            files.setdefault(fname, []).append(name)
    else:
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            files = {"model.safetensors": list(f.keys())}
    out = {}
    for fname, names in files.items():
        with safe_open(str(path / fname), framework="pt") as f:
            for name in names:
                out[name] = f.get_tensor(name)
    return out


def _read_shard(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _ckpt_name(param_name: str, num_hidden_layers: int) -> str:
    """Our module path → the checkpoint's (MTP module k lives at model.layers.{N + k})."""
    return re.sub(r"^mtp\.(\d+)\.", lambda m: f"model.layers.{num_hidden_layers + int(m.group(1))}.", param_name)


def _model_tensors(model) -> dict[str, torch.Tensor]:
    """What the loader fills, by checkpoint name: parameters, router biases, and per-expert views
    of the stacked expert tensors. Every parameter's storage must be covered by these."""
    out = model.checkpoint_tensors()
    covered = {t.untyped_storage().data_ptr() for t in out.values()}
    for n, p in model.named_parameters():
        assert p.untyped_storage().data_ptr() in covered, f"{n} is not reachable from a checkpoint name"
    return out


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    meta = AttentionMetadata.for_contiguous([ids.shape[0]])
    with torch.no_grad():
        return model.compute_logits(model(ids, meta))


def _ids(vocab: int, n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _declare_no_mtp(path: Path) -> None:
    """transformers' DeepseekV3Config defaults to num_nextn_predict_layers=1 while save_pretrained
    writes no MTP tensors; say 0 explicitly (see test_v3_save_pretrained_without_mtp_weights)."""
    cfg_path = Path(path) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["num_nextn_predict_layers"] = 0
    cfg_path.write_text(json.dumps(cfg))


# ---------------------------------------------------------------------------------------------
# fixtures: checkpoints written once per module
# ---------------------------------------------------------------------------------------------
_CACHE: dict = {}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """ckpt(config_name, mtp_layers=0) → (hf_model, sharded checkpoint dir). Do not modify the dir."""

    def get(name: str, mtp_layers: int = 0):
        key = (name, mtp_layers)
        if key not in _CACHE:
            kind, overrides = CONFIGS[name]
            hf = build_hf_model(kind, overrides, seed=3)
            d = tmp_path_factory.mktemp(f"{name}_mtp{mtp_layers}")
            save_hf_model(hf, str(d), max_shard_size="200KB", mtp_layers=mtp_layers, seed=3)
            if not mtp_layers:
                _declare_no_mtp(d)
            _CACHE[key] = (hf, d)
        return _CACHE[key]

    yield get
    _CACHE.clear()


@pytest.fixture
def v3_copy(ckpt, tmp_path):
    """A private copy of the V3 (+1 MTP layer) sharded checkpoint, free to damage."""
    _, src = ckpt("v3_qlora_groups", 1)
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


# ---------------------------------------------------------------------------------------------
# 1. sharded save_pretrained directories load exactly
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,mtp", [("v3_qlora_groups", 1), ("v3_no_qlora_yarn", 0), ("v2_lite_greedy", 0)]
)
def test_sharded_checkpoint_loads_every_tensor_exactly(ckpt, name, mtp):
    hf, path = ckpt(name, mtp)
    wm = _weight_map(path)
    assert len(set(wm.values())) >= 3, "the test needs a checkpoint with several shards"

    model = load_model(path, device="cpu", dtype=torch.float32, progress=False)
    ref = _read_checkpoint(path)
    N = model.config.num_hidden_layers
    ours = _model_tensors(model)

    # every parameter equals its checkpoint tensor, bit for bit
    for pname, t in ours.items():
        cname = _ckpt_name(pname, N)
        assert cname in ref, f"{pname} has no checkpoint tensor {cname}"
        assert t.dtype == torch.float32, pname
        assert torch.equal(t.detach(), ref[cname]), f"{pname} differs from checkpoint {cname}"

    # ... and every checkpoint tensor is used, except the MTP copies of the embedding / head
    used = {_ckpt_name(p, N) for p in ours}
    skipped = set(ref) - used
    assert all(re.fullmatch(rf"model\.layers\.{N + k}\.(embed_tokens|shared_head\.head)\.weight", s)
               for s in skipped for k in [int(s.split(".")[2]) - N]), sorted(skipped)

    # spot checks of names that matter
    last = N - 1
    spot = [
        f"model.layers.{last}.mlp.experts.5.down_proj.weight",
        f"model.layers.{last}.mlp.experts.0.gate_proj.weight",
        f"model.layers.{last}.self_attn.kv_b_proj.weight",
        "model.embed_tokens.weight",
        "lm_head.weight",
    ]
    if model.config.topk_method == "noaux_tc":
        spot.append(f"model.layers.{last}.mlp.gate.e_score_correction_bias")
        bias = model.model.layers[last].mlp.gate.e_score_correction_bias
        assert bias.abs().min() > 0 and torch.equal(bias, ref[spot[-1]])
    for cname in spot:
        assert torch.equal(ours[cname].detach(), ref[cname]), cname
    assert torch.equal(
        model.model.layers[last].mlp.w_down[5].detach(),
        ref[f"model.layers.{last}.mlp.experts.5.down_proj.weight"],
    )

    # the loaded model computes what transformers computes (sanity that the copy is the right one)
    ids = _ids(model.config.vocab_size, 9, seed=1)
    with torch.no_grad():
        hf_logits = hf(ids[None]).logits[0].float()
    assert _rel(_logits(model, ids), hf_logits) <= 1e-4


def test_single_file_checkpoint_loads(ckpt, tmp_path):
    hf, _ = ckpt("v3_qlora_groups", 0)
    hf.save_pretrained(tmp_path, max_shard_size="100MB")
    _declare_no_mtp(tmp_path)
    assert (tmp_path / "model.safetensors").exists() and not (tmp_path / INDEX).exists()
    model = load_model(tmp_path, device="cpu", progress=False)
    ref = _read_checkpoint(tmp_path)
    for pname, t in _model_tensors(model).items():
        assert torch.equal(t.detach(), ref[pname]), pname


def test_default_cpu_dtype_is_fp32(ckpt):
    _, path = ckpt("v3_qlora_groups", 1)
    model = load_model(path, device="cpu", progress=False)
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_v3_save_pretrained_without_mtp_weights(ckpt, tmp_path):
    """A plain transformers save_pretrained of a V3 model (config says 1 MTP layer, no MTP weights)."""
    hf, _ = ckpt("v3_qlora_groups", 0)
    hf.save_pretrained(tmp_path, max_shard_size="200KB")
    assert json.loads((tmp_path / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert not any(n.startswith("model.layers.3.") for n in _weight_map(tmp_path))
    with pytest.warns(UserWarning, match="MTP"):
        model = _load(tmp_path)
    assert len(model.mtp) == 0
    ids = _ids(model.config.vocab_size, 9, seed=8)
    with torch.no_grad():
        hf_logits = hf(ids[None]).logits[0]
    assert _rel(_logits(model, ids), hf_logits) <= 1e-4


def test_mtp_layers_ignored_when_config_has_none(ckpt, tmp_path):
    """A checkpoint that carries MTP tensors, with num_nextn_predict_layers = 0: trunk only."""
    _, src = ckpt("v3_qlora_groups", 1)
    shutil.copytree(src, tmp_path / "c")
    _declare_no_mtp(tmp_path / "c")
    model = load_model(tmp_path / "c", device="cpu", progress=False)
    assert len(model.mtp) == 0


# ---------------------------------------------------------------------------------------------
# 2. MTP layers: mapping, sharing, and computation against transformers' decoder layer
# ---------------------------------------------------------------------------------------------
def _hf_mtp_block(path: Path, ref: dict[str, torch.Tensor], n: int):
    """transformers' DeepseekV3DecoderLayer at layer_idx N with the checkpoint's layer-N weights."""
    from transformers import AutoConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    cfg = AutoConfig.from_pretrained(path)
    cfg._attn_implementation = "eager"
    layer = DeepseekV3DecoderLayer(cfg, layer_idx=n).float().eval()
    pre = f"model.layers.{n}."
    E = cfg.n_routed_experts
    sd = {}
    for key in layer.state_dict():
        if key == "mlp.experts.gate_up_proj":  # [E, 2I, H] = cat(gate, up) per expert
            sd[key] = torch.stack([
                torch.cat([ref[f"{pre}mlp.experts.{e}.{w}_proj.weight"] for w in ("gate", "up")], 0)
                for e in range(E)
            ])
        elif key == "mlp.experts.down_proj":  # [E, H, I]
            sd[key] = torch.stack([ref[f"{pre}mlp.experts.{e}.down_proj.weight"] for e in range(E)])
        else:
            sd[key] = ref[pre + key]
    layer.load_state_dict(sd, strict=True)
    return cfg, layer


@pytest.mark.parametrize("name", ["v3_qlora_groups", "v3_no_qlora_yarn"])
def test_mtp_layer_loaded_shared_and_matches_transformers(ckpt, name):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    _, path = ckpt(name, 1)
    model = load_model(path, device="cpu", dtype=torch.float32, progress=False)
    cfg = model.config
    N, V, Hd = cfg.num_hidden_layers, cfg.vocab_size, cfg.hidden_size
    ref = _read_checkpoint(path)
    pre = f"model.layers.{N}."

    # the module exists and holds the checkpoint's layer-N tensors
    assert cfg.num_nextn_predict_layers == 1 and len(model.mtp) == 1
    assert isinstance(model.mtp[0], MTPLayer)
    for key in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                "self_attn.kv_b_proj.weight", "mlp.experts.3.up_proj.weight", "mlp.gate.e_score_correction_bias"):
        assert torch.equal(model.checkpoint_tensors()[pre + key], ref[pre + key]), key

    # embedding and head are shared with the trunk, not copied
    for key, t in model.mtp.state_dict(keep_vars=True).items():
        assert tuple(t.shape) != (V, Hd), f"mtp holds its own [vocab, hidden] tensor {key}"
    storages = {
        t.untyped_storage().data_ptr()
        for t in list(model.parameters()) + list(model.buffers())
        if t.numel() == V * Hd
    }
    assert len(storages) == 2, f"{len(storages)} [vocab, hidden] storages; expected embed + lm_head only"

    # MTP block vs an independent oracle: checkpoint enorm/hnorm/eh_proj + transformers' decoder layer
    hf_cfg, hf_layer = _hf_mtp_block(path, ref, N)
    T = 7
    g = torch.Generator().manual_seed(11)
    next_ids = torch.randint(0, V, (T,), generator=g)
    prev_hidden = torch.randn(T, Hd, generator=g)
    with torch.no_grad():
        ours = model.mtp_forward(0, next_ids, prev_hidden, AttentionMetadata.for_contiguous([T]))

        eps = hf_cfg.rms_norm_eps
        e = _rms(ref["model.embed_tokens.weight"][next_ids], ref[pre + "enorm.weight"], eps)
        h = _rms(prev_hidden, ref[pre + "hnorm.weight"], eps)
        x = F.linear(torch.cat([e, h], dim=-1), ref[pre + "eh_proj.weight"])[None]  # [1, T, H]
        position_ids = torch.arange(T)[None]
        cos, sin = DeepseekV3RotaryEmbedding(hf_cfg)(x, position_ids)
        mask = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None]
        out = hf_layer(x, attention_mask=mask, position_ids=position_ids, position_embeddings=(cos, sin))
        expected = (out[0] if isinstance(out, tuple) else out)[0]
    assert ours.shape == (T, Hd)
    assert _rel(ours, expected) <= 1e-5

    # MTP head: the trunk's lm_head (== checkpoint shared_head.head) after shared_head.norm
    assert torch.equal(ref[pre + "shared_head.head.weight"], ref["lm_head.weight"])
    hid = torch.randn(T, Hd, generator=g)
    with torch.no_grad():
        logits = model.mtp_logits(0, hid)
    exp_logits = F.linear(_rms(hid, ref[pre + "shared_head.norm.weight"], cfg.rms_norm_eps),
                          ref[pre + "shared_head.head.weight"])
    assert logits.shape == (T, V) and logits.dtype == torch.float32
    assert _rel(logits, exp_logits) <= 1e-6


# ---------------------------------------------------------------------------------------------
# 3. broken checkpoints: clear errors that name the culprit
# ---------------------------------------------------------------------------------------------
def _load(path):
    return load_model(path, device="cpu", dtype=torch.float32, progress=False)


@pytest.mark.parametrize("victim", [
    "model.layers.2.self_attn.kv_b_proj.weight",
    "model.layers.2.mlp.experts.5.up_proj.weight",
    "model.layers.1.mlp.gate.e_score_correction_bias",
    "lm_head.weight",
    "model.layers.3.eh_proj.weight",  # MTP: reported under its checkpoint name, not mtp.0.*
    "model.layers.3.mlp.experts.2.down_proj.weight",
])
def test_missing_tensor_is_named(v3_copy, victim):
    wm = _weight_map(v3_copy)
    shard = v3_copy / wm[victim]
    tensors = _read_shard(shard)
    del tensors[victim]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    idx = json.loads((v3_copy / INDEX).read_text())
    del idx["weight_map"][victim]
    (v3_copy / INDEX).write_text(json.dumps(idx))

    with pytest.raises(CheckpointError) as ei:
        _load(v3_copy)
    assert victim in str(ei.value)


def test_tensor_listed_in_index_but_absent_from_shard_is_named(v3_copy):
    victim = "model.layers.2.self_attn.o_proj.weight"
    shard = v3_copy / _weight_map(v3_copy)[victim]
    tensors = _read_shard(shard)
    del tensors[victim]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as ei:
        _load(v3_copy)
    assert victim in str(ei.value) and shard.name in str(ei.value)


@pytest.mark.parametrize("victim", [
    "model.layers.2.self_attn.kv_b_proj.weight",
    "model.layers.2.mlp.experts.1.gate_proj.weight",
    "model.layers.3.eh_proj.weight",
])
def test_wrong_shape_is_named_with_both_shapes(v3_copy, victim):
    shard = v3_copy / _weight_map(v3_copy)[victim]
    tensors = _read_shard(shard)
    good = tuple(tensors[victim].shape)
    bad = (good[0], good[1] + 3)
    tensors[victim] = torch.randn(bad)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as ei:
        _load(v3_copy)
    msg = str(ei.value)
    assert victim in msg and str(bad) in msg and str(good) in msg, msg


@pytest.mark.parametrize("damage", ["truncate", "header"])
def test_corrupt_shard_names_file(v3_copy, damage):
    victim = "model.layers.2.self_attn.kv_b_proj.weight"
    shard = v3_copy / _weight_map(v3_copy)[victim]
    data = bytearray(shard.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:  # header length field says 2^63: nonsense
        data[:8] = (2**63).to_bytes(8, "little")
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as ei:
        _load(v3_copy)
    assert shard.name in str(ei.value)


def test_corrupt_single_file_checkpoint_names_file(ckpt, tmp_path):
    hf, _ = ckpt("v3_qlora_groups", 0)
    hf.save_pretrained(tmp_path, max_shard_size="100MB")
    _declare_no_mtp(tmp_path)
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(CheckpointError) as ei:
        _load(tmp_path)
    assert "model.safetensors" in str(ei.value)


def test_index_pointing_at_missing_shard(v3_copy):
    victim = "model.layers.2.self_attn.kv_b_proj.weight"
    idx = json.loads((v3_copy / INDEX).read_text())
    idx["weight_map"][victim] = "model-00042-of-00099.safetensors"
    (v3_copy / INDEX).write_text(json.dumps(idx))
    with pytest.raises(CheckpointError) as ei:
        _load(v3_copy)
    msg = str(ei.value)
    assert victim in msg or "model-00042-of-00099.safetensors" in msg, msg


def test_no_weights_at_all(v3_copy):
    for f in v3_copy.glob("*.safetensors*"):
        f.unlink()
    with pytest.raises(CheckpointError) as ei:
        _load(v3_copy)
    assert "model.safetensors" in str(ei.value)


def _edit_config(path: Path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_unsupported_architecture(v3_copy):
    _edit_config(v3_copy, architectures=["LlamaForCausalLM"], model_type="llama")
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM"):
        _load(v3_copy)


def test_missing_config_json(v3_copy, tmp_path):
    (v3_copy / "config.json").unlink()
    with pytest.raises(FileNotFoundError):
        _load(v3_copy)
    with pytest.raises(FileNotFoundError):
        _load(tmp_path / "does_not_exist")


def test_quantized_checkpoint_of_another_method_rejected(v3_copy):
    _edit_config(v3_copy, quantization_config={"quant_method": "gptq", "bits": 4})
    with pytest.raises(UnsupportedModelError, match="gptq"):
        _load(v3_copy)


# ---------------------------------------------------------------------------------------------
# 4. save_checkpoint round trip (and transformers can read what we write)
# ---------------------------------------------------------------------------------------------
def test_save_checkpoint_round_trip_and_transformers_reads_it(ckpt, tmp_path):
    from transformers import DeepseekV3ForCausalLM

    _, src = ckpt("v3_qlora_groups", 1)
    model = _load(src)
    out = tmp_path / "saved"
    out.mkdir()
    save_checkpoint(model, out)
    shutil.copy(src / "config.json", out / "config.json")

    cfg = model.config
    N, V, Hd = cfg.num_hidden_layers, cfg.vocab_size, cfg.hidden_size
    written = _read_checkpoint(out)
    # MTP tensors under model.layers.N, without re-writing the shared embedding / head
    assert f"model.layers.{N}.eh_proj.weight" in written
    assert sum(tuple(t.shape) == (V, Hd) for t in written.values()) == 2
    assert not any(k.startswith("mtp.") for k in written)

    again = _load(out)
    a, b = _model_tensors(model), _model_tensors(again)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k].detach(), b[k].detach()), k

    ids = _ids(V, 13, seed=5)
    logits = _logits(model, ids)
    assert torch.equal(logits, _logits(again, ids))
    meta = AttentionMetadata.for_contiguous([ids.shape[0]])
    with torch.no_grad():
        h = model(ids, meta)
        h2 = again(ids, meta)
        assert torch.equal(model.mtp_logits(0, model.mtp_forward(0, ids, h, meta)),
                           again.mtp_logits(0, again.mtp_forward(0, ids, h2, meta)))

    # transformers reads our file (it ignores the MTP layer): nothing it needs is missing
    hf, info = DeepseekV3ForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"], info["missing_keys"]
    assert not info.get("mismatched_keys"), info["mismatched_keys"]
    with torch.no_grad():
        hf_logits = hf.eval()(ids[None]).logits[0].float()
    assert _rel(logits, hf_logits) <= 1e-4


def test_save_checkpoint_in_shards_round_trips(ckpt, tmp_path):
    """max_shard_bytes: several shards and an index, every tensor back bit for bit."""
    _, src = ckpt("v3_qlora_groups", 1)
    model = _load(src)
    out = tmp_path / "sharded"
    out.mkdir()
    save_checkpoint(model, out, max_shard_bytes=64 << 10)
    shutil.copy(src / "config.json", out / "config.json")
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert set(index["weight_map"]) == set(model.checkpoint_tensors())
    a, b = _model_tensors(model), _model_tensors(_load(out))
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k].detach(), b[k].detach()), k


# ---------------------------------------------------------------------------------------------
# 5. dtype argument
# ---------------------------------------------------------------------------------------------
def test_bf16_load_keeps_router_bias_fp32(ckpt):
    _, path = ckpt("v3_qlora_groups", 1)
    ref = _read_checkpoint(path)
    m32 = load_model(path, device="cpu", dtype=torch.float32, progress=False)
    m16 = load_model(path, device="cpu", dtype=torch.bfloat16, progress=False)
    N = m16.config.num_hidden_layers

    assert {p.dtype for p in m16.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in m32.parameters()} == {torch.float32}
    biases = {n: b for n, b in m16.named_buffers() if n.endswith("e_score_correction_bias")}
    assert len(biases) == len(m16.mtp) + sum(m16.config.is_moe_layer(i) for i in range(N))
    for n, b in biases.items():
        assert b.dtype == torch.float32, n
        assert torch.equal(b, ref[_ckpt_name(n, N)]), n  # not rounded through bf16
    for n, p in m16.checkpoint_tensors().items():
        if n.endswith("e_score_correction_bias"):
            continue
        assert torch.equal(p.detach(), ref[n].to(torch.bfloat16)), n

    # it runs, and agrees with fp32 to bf16 accuracy on most rows (a token whose top-k experts
    # are a near tie may legitimately route differently in bf16, so judge the median row)
    ids = _ids(m16.config.vocab_size, 16, seed=2)
    l16, l32 = _logits(m16, ids), _logits(m32, ids)
    assert l16.dtype == torch.float32 and torch.isfinite(l16).all()
    row_err = (l16 - l32).norm(dim=-1) / l32.norm(dim=-1)
    assert row_err.median() <= 3e-2, row_err


# ---------------------------------------------------------------------------------------------
# tied embeddings (no released DeepSeek checkpoint ties them, but the config flag is honoured)
# ---------------------------------------------------------------------------------------------
def test_tied_embeddings(tmp_path):
    from helpers.hf_models import V3_BASE

    hf = build_hf_model("v3", dict(V3_BASE, tie_word_embeddings=True), seed=4)
    hf.save_pretrained(tmp_path, max_shard_size="200KB")
    _declare_no_mtp(tmp_path)
    assert "lm_head.weight" not in _read_checkpoint(tmp_path)
    model = _load(tmp_path)
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = _ids(model.config.vocab_size, 9, seed=6)
    with torch.no_grad():
        hf_logits = hf(ids[None]).logits[0]
    assert _rel(_logits(model, ids), hf_logits) <= 1e-4
