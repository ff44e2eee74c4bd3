"""The cheaper CPU reranker: distillation into fewer layers, int8 ONNX Runtime, the pair cache."""

import json
import shutil
import time

import numpy as np
import pytest
import torch

from engine.rerank.cross_encoder import Reranker, RerankerError
from engine.rerank.int8 import PLAIN, SMOOTHED, recipe
from engine.rerank.pair_cache import PairCache
from engine.rerank.plan import native_bf16, plan_reranker
from engine.search import HybridEngine
from engine.settings import EngineSettings
from index_build.train_reranker import CARD_FILE, TrainOptions, _keep_layers, train
from offline.dataset import load_dataset
from tests.helpers import short_training


def _disagreement(student: Reranker, teacher: Reranker, engine, beir_dir) -> float:
    """Mean KL divergence between the teacher's and the student's softmax over each training query's
    top 8 (what the student was shown; the tiny corpus is too small to ask for more)."""
    total, queries = 0.0, load_dataset(beir_dir).split_queries("train")
    for text in queries.values():
        ids = [d for d, _ in engine.stages(text, top_k=8).fused[:8]]
        pairs = [(text, p) for p in engine.rerank_passages(text, ids, 0)]
        s, t = torch.tensor(student.logits(pairs)), torch.tensor(teacher.logits(pairs))
        total += float(torch.nn.functional.kl_div(s.log_softmax(0), t.log_softmax(0), log_target=True, reduction="sum"))
    return total / len(queries)


@pytest.fixture(scope="module")
def teacher_dir(reranker_dir, tmp_path_factory) -> str:
    """The seeded cross-encoder with its head scaled up: scores far apart, a teacher worth following."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(reranker_dir)
    with torch.no_grad():
        model.classifier.weight.mul_(40)
    folder = tmp_path_factory.mktemp("teacher")
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(reranker_dir).save_pretrained(folder)
    return str(folder)


@pytest.mark.slow
def test_distilled_student_has_fewer_layers_and_follows_its_teacher(index_dir, beir_dir, teacher_dir, tmp_path):
    """The student trained on the teacher's scores ends closer to the teacher than the same student
    trained the same way on the judgments alone."""
    reranker_dir = teacher_dir
    students = {}
    for weight in (1.0, 0.0):
        settings, options = short_training(
            index_dir,
            beir_dir,
            tmp_path / f"weight-{weight}",
            base=reranker_dir,
            distil_from=reranker_dir,
            student_layers=2,
            freeze_layers=1,  # the embeddings and first layer fixed, as CPU runs train: backward stops early
            distil_weight=weight,
            max_steps=12,
            lr=3e-4,
            eval_every=12,
            memory_context=0,
        )
        # eager torch in fp32 for the teacher, the checkpoints' dev scores and the students read back:
        # what is learned does not depend on the runtime, and an ONNX export and int8 calibration a
        # load cost most of this test's time (the int8 student: test_build_can_distil_the_cpu_student)
        settings = settings.model_copy(update={"rerank_runtime": "torch", "rerank_quantize": "none"})
        card = train(settings, options, load_dataset(beir_dir), progress=False)
        students[weight] = (settings, card)
    settings, card = students[1.0]
    engine = HybridEngine(settings.model_copy(update={"rerank": False}))
    teacher = Reranker(reranker_dir, "cpu", max_length=64, runtime="torch", quantize="none")

    assert card["layers"] == 2 and card["teacher"]["layers"] == 6 and card["teacher"]["path"] == reranker_dir
    assert "distilled" in card["loss"] and card["options"]["distil_from"] == reranker_dir
    saved = json.loads((settings.index_dir / "reranker" / CARD_FILE).read_text())
    assert (
        saved["layers"] == 2
        and json.loads((settings.index_dir / "reranker" / "config.json").read_text())["num_hidden_layers"] == 2
    )
    student = HybridEngine(settings.model_copy(update={"max_length": None})).reranker
    assert student.model.transformers_model.config.num_hidden_layers == 2 and student.runtime == "torch"
    plain = HybridEngine(students[0.0][0].model_copy(update={"max_length": None})).reranker
    assert _disagreement(student, teacher, engine, beir_dir) < _disagreement(plain, teacher, engine, beir_dir)


def test_a_student_keeps_the_first_and_last_layers(reranker_dir):
    from transformers import AutoModelForSequenceClassification

    teacher = AutoModelForSequenceClassification.from_pretrained(reranker_dir)
    student = AutoModelForSequenceClassification.from_pretrained(reranker_dir)
    _keep_layers(student, 3)
    kept = student.bert.encoder.layer
    assert len(kept) == student.config.num_hidden_layers == 3
    for mine, theirs in zip(kept, [teacher.bert.encoder.layer[i] for i in (0, 2, 5)], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(mine.parameters(), theirs.parameters(), strict=True))
    with pytest.raises(ValueError, match="only 6 layers"):
        _keep_layers(AutoModelForSequenceClassification.from_pretrained(reranker_dir), 7)


def test_distilling_into_the_teachers_own_folder_is_refused(index_dir, beir_dir):
    settings = EngineSettings(index_dir=index_dir, device="cpu")
    teacher = str(index_dir / "reranker")
    with pytest.raises(ValueError, match="the folder the student would replace"):
        train(
            settings,
            TrainOptions(base=teacher, distil_from=teacher, max_steps=1),
            load_dataset(beir_dir),
            progress=False,
        )


def test_int8_scores_stay_near_fp32(reranker_dir, engine, tmp_path):
    folder = tmp_path / "reranker"
    shutil.copytree(reranker_dir, folder)
    docs = [c.contents for c in engine.store.chunks(engine.dense.units.unit_ids()).values()]
    query = "coffee and liver enzymes"
    fp32 = Reranker(str(folder), "cpu", max_length=64, quantize="none")
    int8 = Reranker(str(folder), "cpu", max_length=64, quantize="int8")
    assert int8.runtime == "onnx-int8" and int8.backend.onnx.path.name == "model-first-token-int8.onnx"
    assert recipe(int8.backend.onnx.path) == PLAIN  # no text to smooth on
    assert (
        int8.backend.onnx.path.stat().st_size < fp32.backend.onnx.path.stat().st_size * 0.8
    )  # int8 weights, fp32 embeddings
    a, b = np.array(fp32.logits([(query, d) for d in docs])), np.array(int8.logits([(query, d) for d in docs]))
    from scipy.stats import spearmanr

    assert spearmanr(a, b)[0] > 0.9 and np.abs(a - b).max() < 0.2 * (a.max() - a.min())


def test_int8_needs_onnx_runtime(reranker_dir):
    with pytest.raises(RerankerError, match="needs the ONNX runtime"):
        Reranker(reranker_dir, "cpu", runtime="torch", quantize="int8")


def test_bf16_ranks_as_fp32(reranker_dir, engine):
    docs = [c.contents for c in engine.store.chunks(engine.dense.units.unit_ids()).values()]
    pairs = [("coffee and liver enzymes", d) for d in docs]
    fp32 = Reranker(reranker_dir, "cpu", max_length=64, quantize="none")
    bf16 = Reranker(reranker_dir, "cpu", max_length=64, quantize="bf16")
    assert fp32.runtime == "onnx" and bf16.runtime == "torch-bf16" and bf16.plan.backend == "torch"
    assert next(bf16.model.transformers_model.parameters()).dtype == torch.bfloat16
    a, b = np.array(fp32.logits(pairs)), np.array(bf16.logits(pairs))
    from scipy.stats import spearmanr

    assert spearmanr(a, b)[0] > 0.98 and np.abs(a - b).max() < 0.05 * (a.max() - a.min())


def test_auto_precision_is_bf16_only_where_the_cpu_multiplies_bf16(reranker_dir):
    native = native_bf16()  # the kernel's CPU flags, read without importing torch: they say what torch's probes say
    assert native == any(
        getattr(torch.cpu, p, lambda: False)() for p in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    )
    assert plan_reranker("cpu", bf16_native=True).runtime == "torch-bf16"
    assert plan_reranker("cpu", bf16_native=False).runtime == "onnx"
    assert Reranker(reranker_dir, "cpu", max_length=32).runtime == ("torch-bf16" if native else "onnx")
    assert Reranker(reranker_dir, "cpu", max_length=32, runtime="onnx").runtime == "onnx"  # asked for, kept
    assert Reranker(reranker_dir, "cpu", max_length=32, runtime="torch").runtime == "torch"  # fp32, as trained


def test_bf16_needs_the_torch_runtime(reranker_dir):
    with pytest.raises(RerankerError, match="bf16 needs the torch runtime"):
        Reranker(reranker_dir, "cpu", runtime="onnx", quantize="bf16")


def test_bf16_logits_come_out_of_an_fp32_head(reranker_dir):
    bf16 = Reranker(reranker_dir, "cpu", max_length=32, quantize="bf16")
    model = bf16.model.transformers_model
    assert model.bert.encoder.layer[0].output.dense.weight.dtype == torch.bfloat16
    assert model.classifier.weight.dtype == model.bert.pooler.dense.weight.dtype == torch.float32
    features = {k: torch.from_numpy(v) for k, v in bf16.tokenize([("coffee", "coffee and the liver")]).items()}
    with torch.inference_mode():
        assert bf16.backend.first_token(**features).dtype == torch.float32  # not rounded to bf16's 8 bits


def test_pair_cache_scores_each_pair_once_within_its_lifetime():
    computed: list[tuple[str, str]] = []

    def compute(pairs):
        computed.extend(pairs)
        return [float(len(q) + len(p)) for q, p in pairs]

    cache = PairCache(100, ttl_s=0.2)
    first = cache.scores([("q", "a"), ("q", "bb")], compute)
    again = cache.scores([("q", "bb"), ("q", "a"), ("q2", "a")], compute)
    assert first == [2.0, 3.0] and again == [3.0, 2.0, 3.0]
    assert computed == [("q", "a"), ("q", "bb"), ("q2", "a")] and (cache.hits, cache.misses) == (2, 3)
    assert cache.scores([("q", "a "), ("q a", "")], compute) == [3.0, 3.0]  # other texts, other keys
    time.sleep(0.3)
    cache.scores([("q", "a")], compute)
    assert computed[-1] == ("q", "a") and cache.misses == 6  # expired


def test_engine_reuses_cached_scores_for_a_repeated_question(index_dir, reranker_dir):
    engine = HybridEngine(EngineSettings(index_dir=index_dir, device="cpu", reranker=reranker_dir, rerank_depth=6))
    cache = engine.reranker.cache
    first = engine.search("caffeine liver", 3)
    misses = cache.misses
    assert misses >= 6 and cache.hits == 0
    second = engine.search("caffeine liver", 3)
    assert cache.misses == misses and cache.hits == misses
    assert [(h.doc_id, h.rerank_score) for h in first] == [(h.doc_id, h.rerank_score) for h in second]
    plain = HybridEngine(EngineSettings(index_dir=index_dir, device="cpu", reranker=reranker_dir, rerank_cache_size=0))
    assert plain.reranker.cache is None


def test_long_passages_are_cut_before_tokenizing_without_changing_scores(reranker_dir):
    reranker = Reranker(reranker_dir, "cpu", max_length=64, quantize="none")
    words = "caffeine intake was associated with lower liver enzyme levels in the cohort".split()
    passage = " ".join(words[i % len(words)] for i in range(2000))  # ~13,000 characters
    pairs = [("coffee", passage[::-1]), ("coffee and the liver", passage)]  # the order the model batches them in
    whole = reranker.tokenize(pairs)
    assert reranker.logits(pairs) == [float(s) for s in reranker.backend.onnx.run(whole)]


@pytest.mark.slow
def test_build_can_distil_the_cpu_student(beir_dir, teacher_dir, tmp_path, capsys):
    from cli.main import main

    target = tmp_path / "idx"
    args = ["build", "--data", str(beir_dir), "--index-dir", str(target), "--device", "cpu"]
    # one step: one dev checkpoint, so one int8 export and calibration (two steps made two)
    assert main([*args, "--distil-from", teacher_dir, "--distil-steps", "1", "--max-length", "48"]) == 0
    card = json.loads((target / "reranker" / CARD_FILE).read_text())
    assert card["layers"] == 3 and card["steps"] == 1 and card["max_length"] == 48
    assert card["teacher"]["path"] == teacher_dir and card["teacher"]["layers"] == 6
    assert "student reranker" in capsys.readouterr().out
    assert card["cpu_quantize"] == "int8" and card["eval_rerank"]["quantize"] == "auto"
    engine = HybridEngine(EngineSettings(index_dir=target, device="cpu"))
    assert engine.reranker.model.transformers_model.config.num_hidden_layers == 3
    assert engine.reranker.runtime == "onnx-int8"  # a CPU student is served in int8 by default
    assert (
        HybridEngine(EngineSettings(index_dir=target, device="cpu", rerank_quantize="none")).reranker.runtime == "onnx"
    )


def test_the_engine_runs_numpy_blas_on_one_thread(index_dir):
    """BLAS threads left spinning after the memory's per-query product slowed the reranker run next."""
    from threadpoolctl import threadpool_info, threadpool_limits

    threadpool_limits(2, user_api="blas")
    HybridEngine(EngineSettings(index_dir=index_dir, device="cpu", rerank=False)).close()
    assert {p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"} == {1}


def test_pairs_tokenize_as_the_hugging_face_tokenizer_reading_less(reranker_dir):
    from transformers import AutoTokenizer

    from engine.rerank.pair_tokens import PairTokenizer

    tokenizer = AutoTokenizer.from_pretrained(reranker_dir)
    sentence = "Caffeine intake was associated with lower liver enzyme levels in the cohort. "
    passages = [
        "short",
        sentence * 3,  # about the window: may be cut, then read again in full
        sentence * 200,  # long: the first cut fills the window
        "a, b. c; d: " * 300,  # 1-2 characters a token: the first cut comes up short
        "x" * 3000,  # no space to cut at
        "Ünïcödé résumé naïve café " * 80,
        "",
    ]
    names = ["input_ids", "attention_mask", "token_type_ids"]
    for query in ("coffee and the liver", "does a very long question about coffee and liver enzymes matter"):
        pairs = [(query, p) for p in passages]
        ours = PairTokenizer(tokenizer, 48)(pairs)
        theirs = tokenizer(
            [q for q, _ in pairs],
            [p for _, p in pairs],
            padding=True,
            truncation="only_second",
            max_length=48,
            return_tensors="np",
        )
        for name in names:
            assert np.array_equal(ours[name], theirs[name]), name


def test_a_question_longer_than_the_window_is_still_reranked(index_dir, reranker_dir):
    engine = HybridEngine(EngineSettings(index_dir=index_dir, device="cpu", reranker=reranker_dir, max_length=32))
    question = " ".join(["does drinking coffee every day change liver enzyme levels"] * 20)
    result = engine.stages(question, top_k=3)
    assert result.reranked is not None and len(result.rerank_scores) == engine.rerank_depth
    assert engine.reranker_health.failures == 0


def test_the_trace_writes_attention_out_and_a_trace_by_an_older_recipe_is_redone(reranker_dir, tmp_path):
    import onnx

    from engine.onnx import TRACE, TRACE_KEY
    from engine.rerank.onnx import FIRST_TOKEN_TRACE

    folder = tmp_path / "reranker"
    shutil.copytree(reranker_dir, folder)
    traced = Reranker(str(folder), "cpu", max_length=32, quantize="none").backend.onnx.path
    model = onnx.load(str(traced))
    assert {p.key: p.value for p in model.metadata_props} == {TRACE_KEY: FIRST_TOKEN_TRACE}
    assert "IsNaN" not in {node.op_type for node in model.graph.node}  # SDPA guards each layer's scores with it
    del model.metadata_props[:]
    onnx.save(model, str(traced))  # as a trace made before recipes were recorded
    assert Reranker(str(folder), "cpu", max_length=32, quantize="none").backend.onnx.path == traced
    assert {p.key: p.value for p in onnx.load(str(traced)).metadata_props} == {TRACE_KEY: FIRST_TOKEN_TRACE}
    model = onnx.load(str(traced))  # a trace by the whole-model recipe is made again too
    onnx.helper.set_model_props(model, {TRACE_KEY: TRACE})
    onnx.save(model, str(traced))
    Reranker(str(folder), "cpu", max_length=32, quantize="none")
    assert {p.key: p.value for p in onnx.load(str(traced)).metadata_props} == {TRACE_KEY: FIRST_TOKEN_TRACE}


def test_smoothing_moves_range_into_the_weights_without_changing_the_function(reranker_dir, engine, tmp_path):
    import onnx
    import onnxruntime as ort

    from engine.rerank.int8 import _activation_maxima, _smooth, _weighted_products

    reranker = Reranker(reranker_dir, "cpu", max_length=64, quantize="none")
    traced = reranker.backend.onnx
    docs = [c.contents for c in engine.store.chunks(engine.dense.units.unit_ids()).values()]
    feed = reranker.tokenize([("coffee and liver enzymes", d) for d in docs])
    feed = {name: feed[name] for name in traced.inputs}
    model = onnx.load(str(traced.path))
    products = _weighted_products(model)
    # per layer: Q/K/V share one input, attention output, feed-forward in and out; in the last layer
    # Q reads [CLS] alone (engine/rerank/first_token.py), K and V every token
    assert len(products) == 6 * 4 + 1
    maxima = _activation_maxima(model, products, [feed])
    _smooth(model, products, maxima)
    smoothed = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    plain = ort.InferenceSession(str(traced.path), providers=["CPUExecutionProvider"])
    assert np.allclose(smoothed.run(None, feed)[0], plain.run(None, feed)[0], atol=1e-4)
    assert sum(node.op_type == "Mul" for node in model.graph.node) >= 24


def test_the_engine_smooths_its_int8_reranker_on_the_index_text(index_dir, reranker_dir, tmp_path):
    folder = tmp_path / "reranker"
    shutil.copytree(reranker_dir, folder)
    Reranker(str(folder), "cpu", max_length=64, quantize="int8")  # made plain first, without text
    settings = EngineSettings(index_dir=index_dir, device="cpu", reranker=str(folder), max_length=64)
    int8 = HybridEngine(settings.model_copy(update={"rerank_quantize": "int8"}))
    assert int8.reranker.runtime == "onnx-int8" and recipe(int8.reranker.backend.onnx.path) == SMOOTHED  # made again
    fp32 = HybridEngine(settings)
    query = "coffee and liver enzymes"
    a, b = fp32.stages(query, top_k=8).rerank_scores, int8.stages(query, top_k=8).rerank_scores
    from scipy.stats import spearmanr

    assert a.keys() == b.keys() and spearmanr(list(a.values()), [b[d] for d in a])[0] > 0.9


def test_the_first_token_pass_gives_the_whole_models_logits(reranker_dir, engine):
    from transformers import AutoModelForSequenceClassification

    from engine.rerank.first_token import FirstTokenLogits

    model = AutoModelForSequenceClassification.from_pretrained(reranker_dir, attn_implementation="eager").eval()
    reranker = Reranker(reranker_dir, "cpu", max_length=64, quantize="none")
    docs = [c.contents for c in engine.store.chunks(engine.dense.units.unit_ids()).values()]
    pairs = [("coffee and liver enzymes", d) for d in docs] + [("soy", "tofu")]  # padded rows in the batch
    features = {k: torch.from_numpy(v) for k, v in reranker.tokenize(pairs).items()}
    with torch.inference_mode():
        whole, first = model(**features).logits, FirstTokenLogits.of(model)(**features)
    assert features["attention_mask"].min() == 0 and torch.allclose(whole, first, atol=1e-5)
    assert np.allclose(reranker.logits(pairs), whole[:, 0].numpy(), atol=1e-4)  # the ONNX trace of the pass
    assert FirstTokenLogits.of(AutoModelForSequenceClassification.from_config(_distilbert_config())) is None


def _distilbert_config():
    from transformers import DistilBertConfig

    return DistilBertConfig(n_layers=1, dim=32, hidden_dim=64, n_heads=2, vocab_size=100)


def test_bf16_scores_a_cross_encoder_the_first_token_pass_does_not_know(reranker_dir, tmp_path):
    from transformers import AutoTokenizer, DistilBertConfig, DistilBertForSequenceClassification

    torch.manual_seed(0)
    config = DistilBertConfig(n_layers=2, dim=64, hidden_dim=128, n_heads=2, num_labels=1)
    DistilBertForSequenceClassification(config).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(reranker_dir).save_pretrained(tmp_path)
    bf16 = Reranker(str(tmp_path), "cpu", max_length=32, quantize="bf16")
    fp32 = Reranker(str(tmp_path), "cpu", max_length=32, quantize="none")
    pairs = [("coffee", "coffee and the liver"), ("soy", "tofu and soy milk"), ("tea", "green tea")]
    assert bf16.backend.first_token is None and bf16.runtime == "torch-bf16"  # the whole model runs, in bf16
    assert np.allclose(bf16.logits(pairs), fp32.logits(pairs), atol=0.05)


def test_a_reranker_on_onnx_starts_from_its_trace_without_the_model(reranker_dir, tmp_path):
    """Once a load has traced the model, a reranker on ONNX Runtime starts in a fresh process from
    the facts kept beside the trace and the tokenizer, importing neither sentence-transformers nor
    torch, and scores as the loaded one; a window the facts do not know loads the model once, and
    weights newer than the trace make the facts stale."""
    import os
    import subprocess
    import sys

    from engine.rerank.onnx import ModelFacts
    from offline.server_process import ROOT

    folder = shutil.copytree(reranker_dir, tmp_path / "reranker")
    query, passages = "coffee and liver enzymes", ["coffee lowers liver enzymes", "statins and muscle pain", "x " * 400]
    loaded = Reranker(str(folder), "cpu", max_length=64, quantize="none")  # traces the model, keeps its facts

    def fresh(window: int | None) -> dict:
        code = (
            "import json, sys; from engine.rerank.cross_encoder import Reranker;"
            f" r = Reranker({str(folder)!r}, 'cpu', max_length={window!r}, quantize='none');"
            f" scores = r.score({query!r}, {passages!r});"
            " print(json.dumps({'scores': scores, 'window': r.max_length, 'gflop': r.gflop_per_pair,"
            " 'runtime': r.runtime, 'imported': [m for m in ('sentence_transformers', 'torch') if m in sys.modules]}))"
        )
        run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        return json.loads(run.stdout.splitlines()[-1])

    started = fresh(64)
    assert started["imported"] == [] and started["runtime"] == "onnx"
    assert started["scores"] == loaded.score(query, passages)
    assert (started["window"], started["gflop"]) == (loaded.max_length, loaded.gflop_per_pair)
    own = Reranker(str(folder), "cpu", quantize="none")  # the model's own window: loaded here, not yet kept
    assert fresh(None)["imported"] == []  # kept by the load above
    assert fresh(None)["window"] == own.max_length and own.max_length != 64
    weights = folder / "model.safetensors"
    traced = loaded.backend.onnx.path.stat().st_mtime
    os.utime(weights, (traced + 60, traced + 60))  # retrained after the trace
    assert ModelFacts.recorded(str(folder)) is None
