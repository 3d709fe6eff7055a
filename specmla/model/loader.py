"""HF model directory → `DeepseekForCausalLM`.

Reads config.json, then every tensor of model.safetensors (or the shards named by
model.safetensors.index.json) through safetensors' memory map, one tensor at a time, straight into
the parameter it belongs to (cast to the target dtype/device): peak host memory is the model plus one
tensor, never a second full copy. The model is first built on the meta device, so no random init is
paid for. Every parameter must be found with the right shape; errors name the tensor and the file.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from specmla.config import ModelConfig
from specmla.model.deepseek import DeepseekForCausalLM, MoE, checkpoint_name
from specmla.model.dummy import dummy_model
from specmla.model.fp8 import check_fp8_numerics, use_fp8_numerics_, use_fp8_weights_
from specmla.model.rope import rope_cos_sin_cache
from specmla.model.sharding import shard_model_
from specmla.ops.linear.reference import weight_dequant


class CheckpointError(RuntimeError):
    """A checkpoint directory is missing a tensor, has a mis-shaped one, or a file is unreadable."""


def _checkpoint_files(path: Path) -> dict[str, Path]:
    """tensor name → file holding it."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            return {name: path / fname for name, fname in weight_map.items()}
        except OSError as e:
            raise CheckpointError(f"cannot read {index}: {e.strerror or e}") from e
        except (ValueError, KeyError, TypeError, AttributeError) as e:  # bad JSON or no {"weight_map": {...}}
            raise CheckpointError(f"{index} is not a valid safetensors index (a JSON object with a "
                                  f"'weight_map' object): {e!r}") from e
    single = path / "model.safetensors"
    if not single.exists():
        raise CheckpointError(f"{path} has neither model.safetensors nor model.safetensors.index.json")
    try:
        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}
    except Exception as e:  # corrupted header / truncated file
        raise CheckpointError(f"cannot read {single}: {e}") from e


def load_weights(model: DeepseekForCausalLM, path: str | Path, progress: bool = True,
                 shard: tuple[int, int] | None = None) -> None:
    """Copy every tensor of the checkpoint at `path` into `model` (already materialised). A float8_e4m3fn
    checkpoint weight goes as it is into a float8 parameter (its `weight_scale_inv` is a parameter too) and is
    dequantised with its `weight_scale_inv` (`weight_dequant`) into any other. shard=(rank, world): `model` is that
    rank's shard (`shard_model_`); a tensor it holds a part of is read as that part only (`_rank_part`)."""
    path = Path(path)
    params = model.checkpoint_tensors()  # checkpoint name → destination tensor (view)
    files = _checkpoint_files(path)
    wanted = {name: file for name, file in files.items() if name in params}
    missing = sorted(set(params) - set(wanted))
    if missing:
        raise CheckpointError(f"{path}: missing tensor(s) {missing[:8]}{' ...' if len(missing) > 8 else ''}")

    by_file: dict[Path, list[str]] = {}
    for name, file in wanted.items():
        by_file.setdefault(file, []).append(name)
    bar = tqdm(total=len(wanted), desc="loading weights", unit="tensor", disable=not progress)
    for file, items in by_file.items():
        with _open(file, items[0]) as f:
            available = set(f.keys())
            for ckpt_name in items:
                if ckpt_name not in available:
                    raise CheckpointError(f"tensor {ckpt_name!r} is listed for {file.name} but not stored there")
                dst = params[ckpt_name]
                header = _slice(f, ckpt_name, file)  # shape and dtype, nothing read yet
                part = _rank_part(tuple(header.get_shape()), tuple(dst.shape), shard, ckpt_name, file)
                dequant = header.get_dtype() == "F8_E4M3" and dst.dtype != torch.float8_e4m3fn
                if part is None or dequant:  # a dequantised part is cut after its scales are applied
                    t = _get(f, ckpt_name, file)
                else:
                    t = _get_part(header, ckpt_name, file, *part)
                if not t.is_floating_point():
                    raise CheckpointError(f"tensor {ckpt_name!r} in {file.name} has non-float dtype {t.dtype}")
                if (t.dtype == torch.float8_e4m3fn) != (dst.dtype == torch.float8_e4m3fn):
                    if dst.dtype == torch.float8_e4m3fn:
                        raise CheckpointError(f"tensor {ckpt_name!r} in {file.name} is {t.dtype}, but its layer is "
                                              f"stored as FP8 (the checkpoint scales the layer's other weights)")
                    t = weight_dequant(t, _scale_of(ckpt_name, f, available, file, files))
                    if part is not None:
                        t = t.narrow(part[0], part[1], part[2] - part[1])
                with torch.no_grad():
                    dst.copy_(t)
                bar.update(1)
    bar.close()


def _open(file: Path, first: str):
    if not file.exists():
        raise CheckpointError(f"tensor {first!r} should be in {file}, which does not exist")
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as e:
        raise CheckpointError(f"cannot read {file}: {e}") from e


def _get(f, name: str, file: Path) -> torch.Tensor:
    try:
        return f.get_tensor(name)
    except Exception as e:
        raise CheckpointError(f"cannot read tensor {name!r} from {file}: {e}") from e


def _slice(f, name: str, file: Path):
    """The lazy view of a checkpoint tensor (its shape, dtype and parts, read on indexing)."""
    try:
        return f.get_slice(name)
    except Exception as e:
        raise CheckpointError(f"cannot read tensor {name!r} from {file}: {e}") from e


def _rank_part(shape: tuple[int, ...], want: tuple[int, ...], shard: tuple[int, int] | None, name: str, file: Path):
    """None when checkpoint tensor `name` of `shape` has the destination's shape `want`; else, for a tensor-parallel
    rank, (dim, start, end): the one dim a shard cuts, which holds world × want[dim] in the file, and the rank's
    even part of it (`shard_model_` cuts heads, MLP columns and shared-expert columns in equal consecutive parts, FP8
    scales on the same 128-blocks). Any other mismatch names the tensor and both shapes."""
    if shape == want:
        return None
    if shard is not None and len(shape) == len(want):
        rank, world = shard
        dims = [d for d, (a, b) in enumerate(zip(shape, want)) if a != b]
        if len(dims) == 1 and shape[dims[0]] == world * want[dims[0]]:
            n = want[dims[0]]
            return dims[0], rank * n, (rank + 1) * n
    raise CheckpointError(f"tensor {name!r} in {file.name} has shape {shape}, expected {want}"
                          + (f" (rank {shard[0]} of {shard[1]})" if shard else ""))


def _get_part(header, name: str, file: Path, dim: int, start: int, end: int) -> torch.Tensor:
    """Rows (dim 0) or columns (dim 1) [start, end) of a checkpoint tensor (`_slice`), read without the rest."""
    try:
        return header[start:end] if dim == 0 else header[:, start:end]
    except Exception as e:
        raise CheckpointError(f"cannot read tensor {name!r} from {file}: {e}") from e


def _scale_of(name: str, f, available: set[str], file: Path, files: dict[str, Path]) -> torch.Tensor:
    """The `weight_scale_inv` of float8 checkpoint tensor `name` (from its file, or the file the index names)."""
    scale_name = name + "_scale_inv"
    if scale_name in available:
        return _get(f, scale_name, file)
    if scale_name not in files:
        raise CheckpointError(f"tensor {name!r} in {file.name} is float8_e4m3fn but the checkpoint has no "
                              f"{scale_name!r}")
    with _open(files[scale_name], scale_name) as g:
        return _get(g, scale_name, files[scale_name])


def _drop_absent_mtp_layers(cfg: ModelConfig, path: Path) -> ModelConfig:
    """transformers writes num_nextn_predict_layers=1 into every V3 config.json but saves no MTP
    tensors: run without the MTP modules that the checkpoint does not have (with a warning)."""
    if not cfg.num_nextn_predict_layers:
        return cfg
    names = _checkpoint_files(path)
    present = 0
    while present < cfg.num_nextn_predict_layers and any(
        n.startswith(f"model.layers.{cfg.num_hidden_layers + present}.") for n in names
    ):
        present += 1
    if present < cfg.num_nextn_predict_layers:
        warnings.warn(
            f"{path}: config.json declares {cfg.num_nextn_predict_layers} MTP layer(s), the checkpoint has "
            f"{present}; loading without the missing ones"
        )
        cfg = dataclasses.replace(cfg, num_nextn_predict_layers=present)
    return cfg


WEIGHTS = ("auto", "dequantize")
LOAD_FORMATS = ("safetensors", "dummy")


def load_model(
    path: str | Path,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    max_positions: int | None = None,
    progress: bool = True,
    shard: tuple[int, int] | None = None,
    weights: str = "auto",
    load_format: str = "safetensors",
    fp8_numerics: str = "auto",
) -> DeepseekForCausalLM:
    """Build the model for the directory `path` and load its weights.

    dtype defaults to the checkpoint's (bf16 for real checkpoints) on CUDA and to fp32 on CPU.
    weights: "auto" keeps an FP8 checkpoint's block-scaled e4m3 weights as they are (`model.fp8`), "dequantize"
    turns every one into dtype at load (more memory; for comparison). Unquantised checkpoints load the same
    either way.
    shard=(rank, world): a tensor-parallel rank's part only: the model is cut on the meta device, and each
    checkpoint tensor is read as the part the rank keeps (its experts' tensors only), straight to `device`: host
    memory holds one tensor's part at a time.
    load_format: "safetensors" reads the directory's weights; "dummy" needs its config.json only and builds random
    weights on `device` (`dummy_model`: the shard only, FP8 for an FP8 config unless weights="dequantize").
    fp8_numerics: what the FP8 layers run (`model.fp8.use_fp8_numerics_`): "auto" (the w8a8 kernels on CUDA, the
    dequantised reference on CPU) or "emulate" (the torch emulation of the kernels' w8a8 arithmetic, any device;
    ValueError on a model without FP8 layers).
    """
    if weights not in WEIGHTS:
        raise ValueError(f"weights={weights!r}: expected one of {WEIGHTS}")
    check_fp8_numerics(fp8_numerics)
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r}: expected one of {LOAD_FORMATS}")
    path = Path(path)
    cfg = ModelConfig.from_file(path)
    if load_format == "safetensors":
        cfg = _drop_absent_mtp_layers(cfg, path)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dtype is None:
        if device.type == "cpu":
            dtype = torch.float32
        else:
            dtype = {"float32": torch.float32, "float16": torch.float16}.get(cfg.torch_dtype or "", torch.bfloat16)
    if load_format == "dummy":
        fp8 = cfg.quantization == "fp8" and weights == "auto"
        model = dummy_model(cfg, device, dtype, max_positions, shard, fp8=fp8)
    else:
        fp8_names = set(_checkpoint_files(path)) if cfg.quantization and weights == "auto" else None
        model = empty_model(cfg, device, dtype, max_positions, fp8_names, shard)
        load_weights(model, path, progress=progress, shard=shard)
        model.eval()
    use_fp8_numerics_(model, fp8_numerics)
    return model


def empty_model(cfg: ModelConfig, device: str | torch.device, dtype: torch.dtype,
                max_positions: int | None = None, fp8_names: set[str] | None = None,
                shard: tuple[int, int] | None = None) -> DeepseekForCausalLM:
    """The model of `cfg` on `device` with uninitialised weights, built without a host copy (on the meta
    device, then allocated): tied embeddings re-tied, the rope table built, router biases in fp32. fp8_names: an
    FP8 checkpoint's tensor names; the layers they quantise become FP8 (`use_fp8_weights_`), their padding
    zeroed. shard=(rank, world): that tensor-parallel rank's shard only (`shard_model_`, cut on the meta device)."""
    with torch.device("meta"):
        model = DeepseekForCausalLM(cfg, max_positions=max_positions).to(dtype)
        if fp8_names is not None:
            use_fp8_weights_(model, fp8_names, lambda name: checkpoint_name(name, cfg.num_hidden_layers))
    if shard is not None:
        shard_model_(model, *shard)
    model = model.to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty gives each module its own new Parameter: re-tie
        model.lm_head.weight = model.model.embed_tokens.weight
    # to_empty leaves buffers uninitialised: rebuild the rope table; the router bias stays fp32
    model.cos_sin = rope_cos_sin_cache(cfg.rope, cfg.qk_rope_head_dim, model.max_positions, device=device)
    for module in model.modules():
        if getattr(module, "e_score_correction_bias", None) is not None:
            module.e_score_correction_bias = module.e_score_correction_bias.float()
        if isinstance(module, MoE):
            module.zero_padding_()
    return model


def save_checkpoint(model: DeepseekForCausalLM, path: str | Path, max_shard_bytes: int | None = None) -> None:
    """Write the model's tensors to `path` with HF checkpoint names (per-expert tensors, MTP modules as
    model.layers.{num_hidden_layers + i}.*, their shared embedding/head not written again: the loader uses the
    trunk's), as `save_tensors` lays them out."""
    save_tensors(model.checkpoint_tensors(), path, max_shard_bytes)


def save_tensors(tensors: dict[str, torch.Tensor], path: str | Path, max_shard_bytes: int | None = None) -> None:
    """Write named tensors to `path`/model.safetensors, or with max_shard_bytes to shards
    model-0000i-of-0000n.safetensors of about that size and model.safetensors.index.json, one shard at a time
    through host memory."""
    path = Path(path)
    if max_shard_bytes is None:
        save_file({name: t.detach().contiguous().cpu() for name, t in tensors.items()}, str(path / "model.safetensors"),
                  metadata={"format": "pt"})
        return
    shards, size = [[]], 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    weight_map, total = {}, 0
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        part = {n: tensors[n].detach().to("cpu", copy=True).contiguous() for n in names}
        total += sum(t.numel() * t.element_size() for t in part.values())
        save_file(part, str(path / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, fname))
        del part
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
