"""Cold-codec accuracy on SmolLM2: does a quantized cold tier change the answers?

A 2048-token agent history is prefilled once (fp32) into hot-pool blocks. For each cold codec
(raw, int8, fp8) the first 80 % of its blocks are round-tripped through the codec
(encode -> decode), the session is resumed from those blocks (the rest prefilled), and greedy
decoding runs for a fixed number of tokens. Reported per codec: relative L2 error of K and V,
payload size per block, max |logit| difference of the first answer token and whether the
greedy tokens differ from the exact (raw, unmodified) resume.

    python -m bench.codec_accuracy
"""

from __future__ import annotations

import os
import sys

import torch

from bench.common import Goal, Result, print_table, write_result
from bench.resume import BLOCK_TOKENS, CACHE_DIR, QUESTION, history_ids
from kvagentd.config import ModelConfig
from kvagentd.engine.cache import new_cache
from kvagentd.engine.model import load_model, model_geometry
from kvagentd.engine.sessions import ChatFormat
from kvagentd.kvcache.codec import make_codec

CONTEXT = 2048
FRACTION = 0.8
DECODE = int(os.environ.get("KVAGENTD_CODEC_DECODE", "32"))
CODECS = ("raw", "int8", "fp8")


def resume_and_decode(model, geo, arena, n_blocks: int, ids: list[int],
                      margins: list[float] | None = None) -> tuple[torch.Tensor, list[int]]:
    """First-token logits and DECODE greedy tokens; `margins` gets each step's top-1 - top-2."""
    cache = new_cache(geo, arena, len(ids) + DECODE)
    cache.load_blocks(list(range(n_blocks)))
    out = []
    with torch.no_grad():
        x = torch.tensor([ids[n_blocks * BLOCK_TOKENS:]])
        first = None
        for _ in range(DECODE):
            logits = model(input_ids=x, cache=cache, logits_to_keep=1).logits[0, -1]
            if first is None:
                first = logits.clone()
            tok = int(logits.argmax())
            if margins is not None:
                top = logits.topk(2).values
                margins.append(float(top[0] - top[1]))
            out.append(tok)
            x = torch.tensor([[tok]])
    return first, out


def main() -> int:
    lm = load_model(ModelConfig(source="embedded", device="cpu", dtype="float32"), CACHE_DIR)
    model = lm.model
    geo = model_geometry(model, BLOCK_TOKENS, lm.dtype)
    chat = ChatFormat(lm.tokenizer)
    ids = history_ids(lm.tokenizer, CONTEXT) + chat.next_turn(QUESTION)
    total_blocks = len(ids) // BLOCK_TOKENS
    n_rt = int(CONTEXT * FRACTION) // BLOCK_TOKENS  # blocks round-tripped (first 80 %)
    arena = torch.empty((total_blocks + 4, *geo.block_shape), dtype=lm.dtype)
    with torch.no_grad():
        c = new_cache(geo, arena, len(ids))
        c.bind_new_slots(list(range(arena.shape[0])))
        model(input_ids=torch.tensor([ids]), cache=c, logits_to_keep=1)
    exact = arena[:n_rt].clone()
    ref_margins: list[float] = []
    ref_logits, ref_tokens = resume_and_decode(model, geo, arena, n_rt, ids, ref_margins)
    rows, figures = [], {"context_tokens": CONTEXT, "round_tripped_tokens": n_rt * BLOCK_TOKENS,
                         "decode_tokens": DECODE, "codecs": {}}
    for name in CODECS:
        codec = make_codec(name, geo)
        payload = torch.empty((n_rt, codec.payload_nbytes), dtype=torch.uint8)
        codec.encode(exact, payload)
        back = torch.empty_like(exact)
        codec.decode(payload, back)
        k_err = float((back[:, :, 0] - exact[:, :, 0]).norm() / exact[:, :, 0].norm())
        v_err = float((back[:, :, 1] - exact[:, :, 1]).norm() / exact[:, :, 1].norm())
        arena[:n_rt].copy_(back)
        logits, tokens = resume_and_decode(model, geo, arena, n_rt, ids)
        arena[:n_rt].copy_(exact)
        same = sum(1 for a, b in zip(tokens, ref_tokens) if a == b)
        first_diff = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), None)
        f = {"payload_bytes": codec.payload_nbytes, "size_vs_raw": codec.payload_nbytes / geo.block_bytes,
             "k_rel_l2": k_err, "v_rel_l2": v_err,
             "first_token_max_logit_diff": float((logits - ref_logits).abs().max()),
             "greedy_tokens_equal": tokens == ref_tokens, "first_divergence": first_diff,
             "tokens_equal": same,
             "ref_top2_margin_at_divergence": None if first_diff is None else ref_margins[first_diff],
             "ref_min_top2_margin": min(ref_margins)}
        figures["codecs"][name] = f
        rows.append([name, f"{f['size_vs_raw']:.3f}", f"{100 * k_err:.3f} %", f"{100 * v_err:.3f} %",
                     f"{f['first_token_max_logit_diff']:.4f}",
                     "yes" if f["greedy_tokens_equal"] else
                     f"no: from token {first_diff + 1} (ref top-2 gap there "
                     f"{f['ref_top2_margin_at_divergence']:.3f})"])
    print_table(["codec", "size/raw", "K rel L2", "V rel L2", "max |dlogit| tok 1",
                 f"greedy {DECODE} tokens unchanged"], rows,
                title=f"Cold codecs on SmolLM2 fp32: first {n_rt * BLOCK_TOKENS} of {len(ids)} tokens "
                      f"round-tripped")
    c = figures["codecs"]
    print(f"reference resume: smallest top-1/top-2 logit gap over the {DECODE} steps "
          f"{min(ref_margins):.3f}")
    goals = [
        Goal("int8 K relative L2 error", 100 * c["int8"]["k_rel_l2"], "<=", 1.0, "%"),
        Goal("int8 V relative L2 error", 100 * c["int8"]["v_rel_l2"], "<=", 2.0, "%"),
        Goal(f"int8: greedy tokens unchanged of {DECODE}", float(c["int8"]["tokens_equal"]),
             ">=", float(DECODE)),
        Goal("raw: bit-exact round trip (K error)", c["raw"]["k_rel_l2"], "<=", 0.0),
    ]
    write_result(Result("codec_accuracy", "python -m bench.codec_accuracy", figures, goals))
    return 0


if __name__ == "__main__":
    sys.exit(main())
