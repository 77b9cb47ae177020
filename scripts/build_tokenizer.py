"""Train the shipped offline tokenizer: byte-level BPE, vocab 2048, on the stdlib's own .py files.

The result is committed as ``torchtitan_ext/assets/tokenizer/{tokenizer.json,tokenizer_config.json}``
so training and tests never need the network. vocab_size 2048 matches torchtitan's llama3
``debugmodel`` flavor (``TransformerModelArgs(..., vocab_size=2048)``), special tokens included.

Examples:
    python scripts/build_tokenizer.py                      # rebuild the shipped tokenizer
    python scripts/build_tokenizer.py --out /tmp/tok --check
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from torchtitan_ext.data import TOKENIZER_PATH, _read_text, stdlib_files  # noqa: E402

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def build(files: list[Path], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    # GPT-2 style byte-level: every byte is in the base alphabet, so any text round-trips.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],  # ids 0 and 1
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    # Deterministic order: sorted relative paths (stdlib_files), read in that order.
    tok.train_from_iterator((_read_text(p) for p in files), trainer=trainer, length=len(files))
    return tok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=TOKENIZER_PATH, help="output directory (default: the shipped one)")
    ap.add_argument("--vocab-size", type=int, default=2048, help="total vocabulary incl. special tokens")
    ap.add_argument("--stdlib", default=None, help="stdlib root (default sysconfig stdlib)")
    ap.add_argument("--check", action="store_true", help="load with torchtitan's HuggingFaceTokenizer and round-trip")
    args = ap.parse_args(argv)
    if args.vocab_size < 258:
        raise SystemExit(f"error: --vocab-size must be >= 258 (256 bytes + BOS + EOS), got {args.vocab_size}")

    files = stdlib_files(args.stdlib)
    nbytes = sum(p.stat().st_size for p in files)
    t0 = time.perf_counter()
    tok = build(files, args.vocab_size)
    dt = time.perf_counter() - t0

    args.out.mkdir(parents=True, exist_ok=True)
    tok_path = args.out / "tokenizer.json"
    tok.save(str(tok_path))
    config = {
        "bos_token": BOS,
        "eos_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
    }
    (args.out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    digest = hashlib.sha256(tok_path.read_bytes()).hexdigest()[:16]
    print(
        f"trained on {len(files)} files ({nbytes / 1e6:.1f} MB) in {dt:.1f} s: vocab {tok.get_vocab_size()}, "
        f"{tok_path} {tok_path.stat().st_size / 1e3:.0f} KB sha256 {digest}"
    )

    if args.check:
        from torchtitan_ext import _compat

        _compat.apply()  # torchtitan 0.2.2 on CPU needs start-up patches (docs/guides/torchtitan.md)
        from torchtitan.components.tokenizer import HuggingFaceTokenizer

        t = HuggingFaceTokenizer(tokenizer_path=str(args.out))
        text = _read_text(files[0])
        ids = t.encode(text, add_bos=True, add_eos=True)
        ok = t.decode(ids, skip_special_tokens=True) == text and ids[0] == t.bos_id and ids[-1] == t.eos_id
        print(f"check: bos_id={t.bos_id} eos_id={t.eos_id} vocab={t.get_vocab_size()} round-trip={'ok' if ok else 'FAILED'}")
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
