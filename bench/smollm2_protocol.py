"""The SmolLM2 quality protocol of ../shared/MODELS.md, shared by the bench quality scripts.

The model is the GGUF the tests fetch (tests/conftest.py: smollm2_gguf) under $QUANTKIT_CACHE or
~/.cache/quantkit ($QK_GGUF overrides); the text comes from ../shared/data/wikitext2 beside the
checkout ($QK_DATA overrides). Calibration: 128 windows of 512 tokens at random offsets (torch seed 0)
of valid.tokens.txt. Perplexity: test.raw.txt in non-overlapping windows of 2048, the first 40, on the
device the model sits on. The peers' scripts import these functions too, so every row sees the same
tokens and the same scoring.
"""
import math
import os

import torch
import torch.nn.functional as F

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CACHE = os.environ.get("QUANTKIT_CACHE", os.path.expanduser("~/.cache/quantkit"))
GGUF = os.environ.get("QK_GGUF", os.path.join(_CACHE, "smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"))
DATA = os.environ.get("QK_DATA", os.path.join(os.path.dirname(_REPO), "shared", "data", "wikitext2"))


def tokens_of_txt(tok, path):
    """A text file's lines joined with blank lines, tokenized once without special tokens."""
    with open(path, encoding="utf-8") as f:
        text = "\n\n".join(f.read().split("\n"))
    return torch.tensor(tok(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def calibration(tok, n=128, seqlen=512, seed=0):
    """``[n, seqlen]`` calibration windows at seeded random offsets of valid.tokens.txt."""
    ids = tokens_of_txt(tok, f"{DATA}/valid.tokens.txt")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - seqlen, (n,), generator=g)
    return torch.stack([ids[s : s + seqlen] for s in starts.tolist()])  # [n, seqlen]


@torch.inference_mode()
def ppl(model, ids, seqlen=2048, nwin=40):
    """Perplexity over the first ``nwin`` non-overlapping windows of ``ids``, on the model's device."""
    device = next(model.parameters()).device
    nll, cnt = 0.0, 0
    for w in range(min(nwin, ids.numel() // seqlen)):
        x = ids[w * seqlen : (w + 1) * seqlen][None].to(device)
        logits = model(input_ids=x, use_cache=False).logits[0, :-1].float()
        nll += F.cross_entropy(logits, x[0, 1:], reduction="sum").item()
        cnt += seqlen - 1
    return math.exp(nll / cnt)


def load_protocol(layers=0):
    """The fp32 model and what every row starts from: ``(model, tokenizer, fp_state, test_ids, calib)``.

    ``layers`` > 0 keeps only the first decoder layers (quick runs); ``fp_state`` is a copy of the
    unquantized state dict, loaded back before each row."""
    from quantkit.config import LoadConfig
    from quantkit.models.load import load_model

    lm = load_model(GGUF, LoadConfig(dtype="float32", device="cpu"))
    model, tok = lm.model, lm.tokenizer
    if layers:
        model.model.layers = model.model.layers[:layers]
    fp_state = {k: v.clone() for k, v in model.state_dict().items()}
    return model, tok, fp_state, tokens_of_txt(tok, f"{DATA}/test.raw.txt"), calibration(tok)


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description=__doc__ + "\nRun alone, it says where it looks for the model and the "
                            "text and whether they are there.",
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    for what, path in (("model", GGUF), ("calibration text", f"{DATA}/valid.tokens.txt"),
                       ("test text", f"{DATA}/test.raw.txt")):
        print(f"{what}: {path} ({'present' if os.path.isfile(path) else 'MISSING'})")
