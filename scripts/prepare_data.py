"""Corpus + tokenizer for the embedded model: the Python standard library's own source.

Every machine with Python has this corpus. Files (not lines) are split into train / held-out with a
fixed seed, and the split is written next to the data (`files_train.txt`, `files_heldout.txt`, paths
relative to the stdlib root, with the Python version) so it can be reproduced or checked. A
byte-level BPE tokenizer (Hugging Face `tokenizers`) is trained on the train files only; each file
is encoded as <bos> text <eos>, and the token ids go to `train.bin` / `heldout.bin` (uint16).

    python scripts/prepare_data.py --out data/stdlib [--vocab-size 8192] [--heldout-frac 0.05]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import sysconfig
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm

BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
SKIP_PARTS = {"site-packages", "__pycache__"}


def stdlib_files(root: Path) -> list[Path]:
    files = [p for p in root.rglob("*.py") if not (SKIP_PARTS & set(p.relative_to(root).parts))]
    return sorted(files, key=lambda p: str(p.relative_to(root)))


def read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def write_tokenizer(tok: Tokenizer, out: Path, max_len: int = 4096) -> None:
    tok.save(str(out / "tokenizer.json"))
    chat = ("{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")
    with open(out / "tokenizer_config.json", "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "add_bos_token": True,
                   "add_eos_token": False, "model_max_length": max_len, "chat_template": chat}, f, indent=1)


def encode_files(tok: Tokenizer, texts: list[str]) -> np.ndarray:
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.append(bos)
        ids.extend(enc.ids)
        ids.append(eos)
    return np.asarray(ids, dtype=np.uint16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="data/stdlib")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--heldout-frac", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit-files", type=int, default=None, help="use only the first N files (smoke runs)")
    args = ap.parse_args()
    if args.vocab_size > 65535:
        raise SystemExit("token ids are stored as uint16: vocab must be < 65536")
    root = Path(sysconfig.get_paths()["stdlib"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    files = stdlib_files(root)[: args.limit_files]
    texts = {p: t for p in tqdm(files, desc="reading stdlib") if (t := read(p))}
    names = sorted(texts, key=lambda p: str(p.relative_to(root)))
    rng = random.Random(args.seed)
    heldout = set(rng.sample(names, max(1, int(len(names) * args.heldout_frac))))
    train = [p for p in names if p not in heldout]
    held = [p for p in names if p in heldout]
    header = f"# python {sys.version.split()[0]} stdlib {root}; seed {args.seed}\n"
    for fname, group in (("files_train.txt", train), ("files_heldout.txt", held)):
        (out / fname).write_text(header + "".join(f"{p.relative_to(root)}\n" for p in group))
    tok = train_tokenizer([texts[p] for p in train], args.vocab_size)
    write_tokenizer(tok, out)
    stats = {}
    for split, group in (("train", train), ("heldout", held)):
        arr = encode_files(tok, [texts[p] for p in group])
        arr.tofile(out / f"{split}.bin")
        stats[split] = {"files": len(group), "tokens": int(arr.size), "bytes": sum(len(texts[p]) for p in group)}
    stats["vocab_size"] = tok.get_vocab_size()
    with open(out / "stats.json", "w") as f:
        json.dump(stats, f, indent=1)
    print(json.dumps(stats))


if __name__ == "__main__":
    main()
