"""Self-distil a trained model's MTP module towards its own trunk; the trunk is not touched.

Why: an MTP draft is accepted when it equals the *trunk's* token, not the data's. The DeepSeek-V3 MTP
loss trains the module on the data's next-next token; this script trains it on the trunk's own
next-token distribution one position on (KL(trunk ‖ MTP), teacher-forced on the training corpus), the
way draft models are fitted to their target (Medusa-2's self-distillation, EAGLE's target-generated
data). Only `model.mtp` learns: embedding, layers, final norm and lm_head keep their exact weights,
so no-spec outputs are unchanged and the checkpoint format is the same.

    python scripts/distill_mtp.py --model specmla/assets --data data/stdlib --out DIR --minutes 3   (one H100)
    python scripts/distill_mtp.py --model DIR --data DIR --out DIR --smoke                            (CPU check)
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from specmla.model.loader import load_model, save_checkpoint
from specmla.model.metadata import AttentionMetadata
from train_tiny import batches, evaluate, wall_time_lr


def distill_loss(model, tokens: torch.Tensor, recursive_weight: float = 0.0, recursive_steps: int = 1
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(KL(trunk ‖ MTP), top-1 agreement of the first step) on windows of L + 1 tokens. MTP row i (h_i
    and token i+1) is scored against the trunk's distribution at i+1: the token i+2 a first draft must
    match. With recursive_weight, draft steps 2 .. 1 + recursive_steps too, as the proposer runs them:
    step j's row i takes step j-1's output state of row i and token i+j (the accepted draft before it),
    scored against the trunk at i+j. Its attention reads other step-j rows, where the proposer's reads
    first-step entries: close enough to teach the module its own states as input."""
    B, L1 = tokens.shape
    L = L1 - 1
    meta = AttentionMetadata.for_contiguous([L] * B, device=tokens.device)
    with torch.no_grad():
        hidden = model(tokens[:, :L].reshape(-1), meta)
        teacher = model.compute_logits(hidden).view(B, L, -1)[:, 1:].log_softmax(-1)  # [:, i]: trunk at i+1

    def kl_to_teacher(student: torch.Tensor, first: int) -> torch.Tensor:  # student rows vs teacher[:, first:]
        t = teacher[:, first:]
        return F.kl_div(student.reshape(-1, student.shape[-1]), t.reshape(-1, t.shape[-1]), log_target=True,
                        reduction="batchmean")

    h = model.mtp_forward(0, tokens[:, 1:L1].reshape(-1), hidden, meta)
    student = model.mtp_logits(0, h).view(B, L, -1)[:, : L - 1].log_softmax(-1)
    kl = kl_to_teacher(student, 0)
    agree = (student.argmax(-1) == teacher.argmax(-1)).float().mean()
    rows = L
    for j in range(2, 2 + (recursive_steps if recursive_weight else 0)):
        if L - j < 1:
            break
        prev, rows = h.view(B, rows, -1)[:, : L - j + 1], L - j + 1
        m = AttentionMetadata.for_contiguous([rows] * B, device=tokens.device)  # rope is relative: no shift
        h = model.mtp_forward(0, tokens[:, j:L1].reshape(-1), prev.reshape(B * rows, -1), m)
        student = model.mtp_logits(0, h).view(B, rows, -1)[:, : rows - 1].log_softmax(-1)
        kl = kl + recursive_weight * kl_to_teacher(student, j - 1)
    return kl, agree


def trunk_state(model) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.checkpoint_tensors().items()
            if not n.startswith(f"model.layers.{model.config.num_hidden_layers}")}


def record_run(out: Path, run: dict) -> None:
    """Add the run to `out`/training.json (under "mtp_distillation") and one line to its model card."""
    training = out / "training.json"
    record = json.loads(training.read_text()) if training.exists() else {}
    record["mtp_distillation"] = run
    training.write_text(json.dumps(record, indent=1))
    result, a = run["result"], run["args"]
    card = out / "MODEL_CARD.md"
    text = card.read_text() if card.exists() else "# model\n"
    steps = a.get("recursive_steps", 1)
    rec = (f", the next {steps} recursive draft step{'s' * (steps > 1)} weighted {a['recursive_weight']}"
           if a["recursive_weight"] else "")
    text = text.split("\n- MTP self-distillation")[0].rstrip("\n") + f"""
- MTP self-distillation (`scripts/distill_mtp.py`): the MTP module alone, {result['steps']} steps of
  {a['batch']} × {a['seq']} tokens against the trunk's own next-token distribution (KL{rec}; the trunk is
  frozen and bit-identical), AdamW lr {a['lr']}, {result['train_s'] / 60:.1f} min on {result['device']}:
  MTP top-1 acceptance {100 * result['before']['mtp_acceptance']:.1f} % → **{100 * result['after']['mtp_acceptance']:.1f} %**.
  Reproduce on the directory train_tiny.py wrote: `python scripts/distill_mtp.py --model DIR --data data/stdlib
  --out specmla/assets --minutes {a['minutes']} --recursive-weight {a['recursive_weight']} --recursive-steps {steps}`.
"""
    card.write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="specmla/assets")
    ap.add_argument("--data", default="data/stdlib")
    ap.add_argument("--out", required=True)
    ap.add_argument("--minutes", type=float, default=3.0, help="training time budget")
    ap.add_argument("--max-steps", type=int, default=100000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=float, default=30.0, help="seconds between quick held-out checks")
    ap.add_argument("--recursive-weight", type=float, default=0.5,
                    help="weight of each recursive draft step's loss (0: first step only)")
    ap.add_argument("--recursive-steps", type=int, default=1, help="recursive draft steps trained after the first")
    ap.add_argument("--smoke", action="store_true", help="a few steps, CPU")
    args = ap.parse_args()
    if args.smoke:
        args.batch, args.seq, args.max_steps = 2, 32, 3
    torch.manual_seed(args.seed)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    src, data_dir, out = Path(args.model), Path(args.data), Path(args.out)
    train = np.fromfile(data_dir / "train.bin", dtype=np.uint16)
    heldout = np.fromfile(data_dir / "heldout.bin", dtype=np.uint16)
    model = load_model(src, device=dev, dtype=torch.float32, max_positions=max(args.seq + 1, 64), progress=False)
    if not len(model.mtp):
        raise SystemExit(f"{src} has no MTP layer to distil")
    trunk_before = trunk_state(model)
    for p in model.parameters():
        p.requires_grad_(False)
    params = list(model.mtp.parameters())
    for p in params:
        p.requires_grad_(True)
    seq_eval = min(args.seq, 512)
    windows = 4 if args.smoke else 24
    full = 4 if args.smoke else 256
    before_all = evaluate(model, heldout, seq_eval, max_windows=full)
    before = evaluate(model, heldout, seq_eval, max_windows=windows)
    print(f"before: held-out ppl {before_all['heldout_ppl']:.3f} mtp acceptance {before_all['mtp_acceptance']:.4f}",
          flush=True)
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    budget_s, warmup = args.minutes * 60, min(50, args.max_steps)
    best = (before["mtp_acceptance"], {k: v.detach().clone() for k, v in model.mtp.state_dict().items()}, 0)
    history, evals = [], [(0, 0.0, before["mtp_acceptance"])]
    next_eval, t0, step = args.eval_every, time.perf_counter(), 0
    model.train()
    for step, tokens in enumerate(batches(train, args.batch, args.seq, args.seed + 1), start=1):
        elapsed = time.perf_counter() - t0
        if step > args.max_steps or elapsed > budget_s:
            step -= 1
            break
        if elapsed > next_eval:  # keep the MTP weights with the best held-out acceptance
            next_eval += args.eval_every
            model.eval()
            quick = evaluate(model, heldout, seq_eval, max_windows=windows)["mtp_acceptance"]
            model.train()
            evals.append((step, elapsed, quick))
            print(f"eval step {step}: held-out mtp acceptance {quick:.4f}", flush=True)
            if quick > best[0]:
                best = (quick, {k: v.detach().clone() for k, v in model.mtp.state_dict().items()}, step)
        frac = min(1.0, elapsed / budget_s)
        lr = wall_time_lr(args.lr, step, warmup, frac)
        for group in opt.param_groups:
            group["lr"] = lr
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            kl, agree = distill_loss(model, tokens.to(dev), args.recursive_weight, args.recursive_steps)
        opt.zero_grad(set_to_none=True)
        kl.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 50 == 0 or step <= 3:
            history.append((step, elapsed, kl.item(), agree.item()))
            print(f"step {step} {elapsed:.0f}s kl {kl.item():.4f} top-1 agreement {agree.item():.3f} lr {lr:.2e}",
                  flush=True)
    train_s = time.perf_counter() - t0
    model.eval()
    final = evaluate(model, heldout, seq_eval, max_windows=windows)["mtp_acceptance"]
    if best[0] > final:
        model.mtp.load_state_dict(best[1])
    kept = step if final >= best[0] else best[2]
    after = evaluate(model, heldout, seq_eval, max_windows=full)
    for name, t in trunk_state(model).items():  # the whole point: the trunk is bit for bit the same
        if not torch.equal(t, trunk_before[name]):
            raise RuntimeError(f"trunk tensor {name} changed")
    result = {"before": before_all, "after": after, "steps": step, "kept_step": kept, "train_s": train_s,
              "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"}
    print(json.dumps(result))
    out.mkdir(parents=True, exist_ok=True)
    if out.resolve() != src.resolve():
        for f in src.iterdir():
            if f.is_file() and f.name != "model.safetensors":
                shutil.copy(f, out / f.name)
    dtype = {"float32": torch.float32}.get(model.config.torch_dtype or "", torch.bfloat16)
    save_checkpoint(model.to(dtype), out)
    record_run(out, {"result": result, "history": history, "evals": evals, "args": vars(args)})


if __name__ == "__main__":
    main()
