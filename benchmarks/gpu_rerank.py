"""Reranker pairs/s on a GPU, per numeric path, each checked to rank as fp32 does.

The pairs are what serving scores: each dev query's fused top ``--depth`` candidates, read as the
reranker reads them (memory context included). Per variant: the model alone at one query's depth
(latency of one rerank) and at ``--batch`` pairs (throughput), and Spearman's rho and top-10 overlap
of each query's order against fp32. The physical limit: MiniLM-L6 costs ~21 MFLOP a token of
forward pass (2 x 22.7 M weights, attention on top), so the figures say which fraction of the GPU's
bf16 peak the measured tokens used.

    python -m benchmarks.gpu_rerank --out benchmarks/results/h100/gpu-rerank.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from engine.settings import EngineSettings

GFLOP_PER_PAIR_256 = 5.4  # MiniLM-L6 at 256 tokens, the figure
PEAK_TFLOPS = {"h100": 989.0, "h200": 989.0}  # dense bf16/fp16 tensor peak (SXM)


def _pairs(queries: int, depth: int) -> list[tuple[str, list[tuple[str, str]]]]:
    from engine.search import HybridEngine, SearchOptions
    from offline.dataset import load_dataset
    from serving.settings import Settings

    settings = Settings()
    engine = HybridEngine(settings.engine)
    context = engine.reranker.memory_context if engine.reranker is not None else 0
    fused = SearchOptions(rerank_depth=0)
    out = []
    for query in list(load_dataset(settings.build.data_dir).split_queries("dev").values())[:queries]:
        ids = [h.doc_id for h in engine.search(query, depth, options=fused)]
        out.append((query, [(query, p) for p in engine.rerank_passages(query, ids, context)]))
    return out


def _timed(fn, repeats: int) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / repeats


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def measure(reranker_dir: str, queries: int, depth: int, batch: int, max_length: int) -> dict:
    import torch
    from sentence_transformers import CrossEncoder

    per_query = _pairs(queries, depth)
    base = CrossEncoder(reranker_dir, device="cuda", max_length=max_length, num_labels=1)
    tokenizer = base.tokenizer

    def encode(pairs: list[tuple[str, str]]) -> dict:  # one shape a batch size: compiled graphs are reused
        enc = tokenizer(
            [q for q, _ in pairs],
            [p for _, p in pairs],
            padding="max_length",
            truncation="only_second",
            max_length=max_length,
            return_tensors="pt",
        )
        return {k: v.to("cuda") for k, v in enc.items()}

    inputs = [encode(pairs) for _, pairs in per_query]
    flat = [pair for _, pairs in per_query for pair in pairs]
    big = encode(flat[:batch])
    tokens_per_pair = float(big["attention_mask"].sum()) / big["attention_mask"].shape[0]
    padded = big["input_ids"].shape[1]
    variants: dict[str, dict] = {}
    reference: list[np.ndarray] = []

    def model_variant(name: str, model, dtype) -> None:
        @torch.inference_mode()
        def scores(enc: dict) -> torch.Tensor:
            with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
                return model(**enc).logits.float().view(-1)

        try:
            got = [scores(enc).cpu().numpy() for enc in inputs]
            one = _timed(lambda: scores(inputs[0]), 20)
            many = _timed(lambda: scores(big), 5)
        except Exception as exc:  # a variant that cannot run here is reported, not fatal
            variants[name] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
            return
        if not reference:  # the first variant, fp32, is the reference
            reference.extend(got)
        rho = [_spearman(r, g) for r, g in zip(reference, got, strict=True)]
        top = [
            len(set(np.argsort(-r)[:10]) & set(np.argsort(-g)[:10])) / 10 for r, g in zip(reference, got, strict=True)
        ]
        rate = big["input_ids"].shape[0] / many
        variants[name] = {
            f"ms_for_{depth}_pairs": round(one * 1000, 3),
            "pairs_per_s": round(rate, 1),
            "achieved_tflops_real_tokens": round(rate * tokens_per_pair * GFLOP_PER_PAIR_256 / 256 / 1000, 1),
            "spearman_vs_fp32": round(float(np.mean(rho)), 4),
            "top10_overlap_vs_fp32": round(float(np.mean(top)), 4),
        }
        print(name, variants[name], flush=True)

    hf = base.model.eval()
    model_variant("fp32", hf, None)
    torch.backends.cuda.matmul.allow_tf32 = True
    model_variant("tf32", hf, None)
    torch.backends.cuda.matmul.allow_tf32 = False
    model_variant("bf16-autocast", hf, torch.bfloat16)
    half = CrossEncoder(reranker_dir, device="cuda", max_length=max_length, num_labels=1).model.half().eval()
    model_variant("fp16 (served)", half, None)
    model_variant("fp16 + torch.compile", torch.compile(half, dynamic=True), None)
    model_variant(
        "fp16 + CUDA graphs (compile reduce-overhead)", torch.compile(half, mode="reduce-overhead", dynamic=False), None
    )
    variants["onnxruntime-gpu"] = _onnx_status()

    from engine.rerank.cross_encoder import Reranker

    served = Reranker(reranker_dir, "cuda", max_length=max_length, batch_size=EngineSettings().rerank_batch_for("cuda"))
    served.score_pairs(per_query[0][1])
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _, pairs in per_query:
        served.score_pairs(pairs)
    e2e = (time.perf_counter() - started) / len(per_query)
    flop_limit_ms = depth * GFLOP_PER_PAIR_256 * 1e9 / (PEAK_TFLOPS["h100"] * 1e12) * 1000
    return {
        "reranker": reranker_dir,
        "queries": queries,
        "depth": depth,
        "throughput_batch": batch,
        "max_length": max_length,
        "mean_real_tokens_per_pair": round(tokens_per_pair, 1),
        "padded_length_of_throughput_batch": padded,
        "variants": variants,
        f"served_reranker_ms_for_{depth}_pairs_with_tokenizing": round(e2e * 1000, 2),
        f"flop_limit_ms_for_{depth}_pairs_at_256_tokens": round(flop_limit_ms, 3),
        "gpu": torch.cuda.get_device_name(0),
    }


def _onnx_status() -> dict:
    try:
        import onnxruntime as ort
    except ImportError:
        return {"error": "onnxruntime not installed"}
    providers = ort.get_available_providers()
    if "CUDAExecutionProvider" not in providers:
        return {"error": f"no CUDAExecutionProvider (onnxruntime {ort.__version__}: {providers})"}
    return {"providers": providers}


def main() -> None:
    from offline.records import write_result

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reranker", default=None, help="default: the index's reranker")
    p.add_argument("--queries", type=int, default=50)
    p.add_argument("--depth", type=int, default=100)
    p.add_argument("--batch", type=int, default=800)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    report = measure(
        args.reranker or EngineSettings().reranker_path, args.queries, args.depth, args.batch, args.max_length
    )
    write_result(args.out, report, vars(args))


if __name__ == "__main__":
    main()
