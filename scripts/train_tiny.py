"""Train the embedded MLA + MTP code model with specmla's own model code.

DeepseekV3ForCausalLM format with the production latent shapes (kv_lora_rank 512, 64 rope dims), a
few layers incl. MoE (8 routed experts, top-2, 2 groups) and one MTP module trained with the
DeepSeek-V3 MTP loss (weight 0.3). bf16 autocast, deterministic seed, loss curves to PNG. Writes an
HF-format directory (config.json, model.safetensors with the MTP layer under
model.layers.{num_hidden_layers}.*, tokenizer files, MODEL_CARD.md with the held-out figures).

    python scripts/prepare_data.py --out data/stdlib
    python scripts/train_tiny.py --data data/stdlib --out specmla/assets --minutes 9      (one H100)
    python scripts/train_tiny.py --data data/stdlib --out /tmp/smoke --smoke               (CPU check)
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from specmla.config import ModelConfig
from specmla.model.deepseek import DeepseekForCausalLM
from specmla.model.loader import save_checkpoint
from specmla.model.metadata import AttentionMetadata

MTP_WEIGHT = 0.3


def model_config(vocab_size: int, smoke: bool) -> dict:
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": vocab_size,
        "hidden_size": 320, "intermediate_size": 1280, "moe_intermediate_size": 256, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": None, "kv_lora_rank": 512,
        "qk_nope_head_dim": 64, "qk_rope_head_dim": 64, "v_head_dim": 64, "n_routed_experts": 8,
        "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 2,
        "norm_topk_prob": True, "routed_scaling_factor": 1.0, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "rope_theta": 10000.0, "rope_interleave": True, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "num_nextn_predict_layers": 1, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "initializer_range": 0.02,
    }
    if smoke:
        cfg.update(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
                   kv_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16)
    return cfg


def init_weights(model: DeepseekForCausalLM, std: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)


def batches(data: np.ndarray, batch: int, seq: int, seed: int):
    """Random windows of seq + 1 tokens (the last one is a target only)."""
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(data) - seq - 1, size=batch)
        yield torch.from_numpy(np.stack([data[s : s + seq + 1].astype(np.int64) for s in starts]))


def losses(model: DeepseekForCausalLM, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token loss of the trunk and next-next-token loss of the MTP module (DeepSeek-V3 MTP)."""
    B, L1 = tokens.shape
    L = L1 - 1
    x = tokens[:, :L]
    meta = AttentionMetadata.for_contiguous([L] * B, device=tokens.device)
    hidden = model(x.reshape(-1), meta)  # [B·L, hidden], final-normed
    logits = model.compute_logits(hidden).view(B, L, -1)
    main = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    # MTP at position i: h_i and the embedding of token i+1 → token i+2 (positions 0 .. L-2)
    h_mtp = model.mtp_forward(0, tokens[:, 1 : L + 1].reshape(-1), hidden, meta)
    mtp_logits = model.mtp_logits(0, h_mtp).view(B, L, -1)[:, : L - 1]
    mtp = F.cross_entropy(mtp_logits.reshape(-1, mtp_logits.shape[-1]), tokens[:, 2:].reshape(-1))
    return main, mtp


def wall_time_lr(base: float, step: int, warmup: int, frac: float, floor: float = 0.0) -> float:
    """Linear warm-up over `warmup` steps, then a cosine from base down to floor · base over the fraction
    `frac` of the wall-time budget spent (the run must fit its budget, whatever its step rate)."""
    return base * min(1.0, step / warmup) * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac)))


@torch.no_grad()
def evaluate(model: DeepseekForCausalLM, data: np.ndarray, seq: int, max_windows: int = 64) -> dict:
    """Held-out perplexity, and MTP acceptance: how often the MTP module's top-1 next-next token
    equals the trunk's greedy token at that position (what a 1-token MTP draft would get accepted)."""
    dev = next(model.parameters()).device
    n = min(max_windows, (len(data) - 1) // (seq + 1))
    nll, count, accepted, drafted = 0.0, 0, 0, 0
    for w in range(n):
        t = torch.from_numpy(data[w * (seq + 1) : (w + 1) * (seq + 1)].astype(np.int64))[None].to(dev)
        x = t[:, :seq]
        meta = AttentionMetadata.for_contiguous([seq], device=dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            hidden = model(x.reshape(-1), meta)
            logits = model.compute_logits(hidden)
            h_mtp = model.mtp_forward(0, t[0, 1 : seq + 1], hidden, meta)
            mtp_top = model.mtp_logits(0, h_mtp).argmax(-1)
        nll += F.cross_entropy(logits.float(), t[0, 1:], reduction="sum").item()
        count += seq
        trunk_top = logits.argmax(-1)
        accepted += (mtp_top[: seq - 1] == trunk_top[1:]).sum().item()
        drafted += seq - 1
    return {"heldout_ppl": math.exp(nll / count), "mtp_acceptance": accepted / drafted, "heldout_tokens": count}


def model_card(out: Path, cfg: dict, stats: dict, result: dict, args, train_s: float, n_params: int) -> None:
    text = f"""# specmla embedded model (tiny MLA + MTP, Python code)

- Architecture: DeepseekV3ForCausalLM, {cfg['num_hidden_layers']} layers (first {cfg['first_k_dense_replace']} dense,
  then MoE: {cfg['n_routed_experts']} routed experts top-{cfg['num_experts_per_tok']}, {cfg['n_group']} groups, 1 shared),
  hidden {cfg['hidden_size']}, {cfg['num_attention_heads']} heads, kv_lora_rank {cfg['kv_lora_rank']},
  qk_rope_head_dim {cfg['qk_rope_head_dim']}, one MTP module (model.layers.{cfg['num_hidden_layers']}.*),
  {n_params / 1e6:.1f} M parameters, stored in bf16.
- Data: the Python standard library's own *.py files (see files_train.txt / files_heldout.txt next
  to the data: {stats['train']['files']} train files, {stats['train']['tokens']} tokens;
  {stats['heldout']['files']} held-out files), byte-level BPE, vocab {stats['vocab_size']}.
- Training: {result['steps']} steps (weights of step {result['kept_step']}, the best quick held-out check) of {args.batch} × {args.seq} tokens, AdamW lr {args.lr}, MTP loss weight
  {MTP_WEIGHT}, bf16 autocast, seed {args.seed}, {train_s / 60:.1f} min on {result['device']}.
- Held-out ({result['heldout_tokens']} tokens): perplexity **{result['heldout_ppl']:.2f}**, MTP top-1 acceptance
  (MTP's next-next token == the trunk's greedy token) **{100 * result['mtp_acceptance']:.1f} %**.
- Reproduce: `python scripts/prepare_data.py --out data/stdlib` then
  `python scripts/train_tiny.py --data data/stdlib --out specmla/assets --minutes {args.minutes}`.
"""
    (out / "MODEL_CARD.md").write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="data/stdlib")
    ap.add_argument("--out", default="specmla/assets")
    ap.add_argument("--minutes", type=float, default=9.0, help="training time budget")
    ap.add_argument("--max-steps", type=int, default=100000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=float, default=60.0, help="seconds between quick held-out checks")
    ap.add_argument("--smoke", action="store_true", help="tiny dims, a few steps, CPU")
    args = ap.parse_args()
    if args.smoke:
        args.batch, args.seq, args.max_steps = 2, 32, 3
    torch.manual_seed(args.seed)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data_dir, out = Path(args.data), Path(args.out)
    stats = json.loads((data_dir / "stats.json").read_text())
    train = np.fromfile(data_dir / "train.bin", dtype=np.uint16)
    heldout = np.fromfile(data_dir / "heldout.bin", dtype=np.uint16)
    cfg_dict = model_config(stats["vocab_size"], args.smoke)
    cfg = ModelConfig.from_dict(cfg_dict)
    model = DeepseekForCausalLM(cfg, max_positions=max(args.seq + 1, 64))
    init_weights(model, cfg_dict["initializer_range"], args.seed)
    model = model.to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    budget_s, warmup = args.minutes * 60, 200
    history, evals = [], []
    best = (float("inf"), None, 0)  # (held-out ppl, weights, step): the corpus repeats for several epochs
    next_eval = args.eval_every
    t0 = time.perf_counter()
    step = 0
    for step, tokens in enumerate(batches(train, args.batch, args.seq, args.seed), start=1):
        elapsed = time.perf_counter() - t0
        if step > args.max_steps or elapsed > budget_s:
            step -= 1
            break
        if elapsed > next_eval:  # a quick held-out check; keep the best weights seen
            next_eval += args.eval_every
            model.eval()
            quick = evaluate(model, heldout, min(args.seq, 512), max_windows=24)
            model.train()
            evals.append((step, elapsed, quick["heldout_ppl"], quick["mtp_acceptance"]))
            print(f"eval step {step}: held-out ppl {quick['heldout_ppl']:.2f} mtp {quick['mtp_acceptance']:.3f}",
                  flush=True)
            if quick["heldout_ppl"] < best[0]:
                best = (quick["heldout_ppl"], {k: v.detach().clone() for k, v in model.state_dict().items()}, step)
        frac = min(1.0, elapsed / budget_s)  # schedule by wall time: the run must fit its budget
        lr = wall_time_lr(args.lr, step, warmup, frac, floor=0.1)
        for group in opt.param_groups:
            group["lr"] = lr
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            main_loss, mtp_loss = losses(model, tokens.to(dev))
        loss = main_loss + MTP_WEIGHT * mtp_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step <= 3:
            history.append((step, elapsed, main_loss.item(), mtp_loss.item()))
            print(f"step {step} {elapsed:.0f}s loss {main_loss.item():.3f} mtp {mtp_loss.item():.3f} lr {lr:.2e}",
                  flush=True)
    train_s = time.perf_counter() - t0
    model.eval()
    kept = step
    if best[1] is not None:
        final = evaluate(model, heldout, min(args.seq, 512), max_windows=24)["heldout_ppl"]
        if best[0] < final:
            print(f"held-out ppl {final:.2f} at the end > {best[0]:.2f} at step {best[2]}: keeping step {best[2]}")
            model.load_state_dict(best[1])
            kept = best[2]
    result = evaluate(model, heldout, min(args.seq, 512), max_windows=4 if args.smoke else 256)
    result.update(steps=step, kept_step=kept,
                  device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu")
    print(json.dumps(result))
    out.mkdir(parents=True, exist_ok=True)
    save_checkpoint(model.to(torch.bfloat16), out)
    (out / "config.json").write_text(json.dumps(cfg_dict, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(data_dir / name, out / name)
    (out / "training.json").write_text(json.dumps({"result": result, "history": history, "evals": evals, "args": vars(args)}, indent=1))
    model_card(out, cfg_dict, stats, result, args, train_s, n_params)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        steps = [h[0] for h in history]
        plt.figure(figsize=(6, 3.5))
        plt.plot(steps, [h[2] for h in history], label="next token")
        plt.plot(steps, [h[3] for h in history], label="MTP (next-next token)")
        plt.xlabel("step")
        plt.ylabel("train loss")
        plt.legend()
        plt.tight_layout()
        plt.savefig(out / "loss.png", dpi=110)
    except ImportError:
        print("matplotlib not installed: no loss plot")


if __name__ == "__main__":
    main()
