"""Build the GPU image with podman and check it from outside, as a user would run it.

    python -m benchmarks.container                  # base (pulled, or made), build, run, every check
    python -m benchmarks.container --compose        # also compose.yaml with podman-compose

Steps: a podman configuration that works on this kind of VM (runtime runc when present, explicit
default ulimits) unless ``CONTAINERS_CONF`` is set; the base image (``--base``, else the official
one if a registry answers, else a stand-in of the same distribution and Python made with mmdebstrap
from Ubuntu's archive, or Debian's when Ubuntu's does not answer); ``podman build`` of
Dockerfile.cuda (time, size, no compiler or pip in the final image, a non-root user); a run with the
dataset mounted read-only and a fresh named index volume (the first start builds the index); the
image's HEALTHCHECK until healthy; then, from the host through the published ports only: the a2a-sdk
0.3 client (its own virtual environment, ``.venv-a2a03``) on 100 dev queries, the official MCP
client, REST search, a document written and read back, an agent protocol message traced (sent
from inside: the protocol serves loopback clients only); ``podman stop`` (SIGTERM: exit 0), start
again (the volume's index reused, the document and the message's trace still there); a missing and a corrupt dataset
(a clear message, a non-zero exit). Everything measured goes to benchmarks/results/container.json.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from benchmarks import options
from offline.records import write_result

ROOT = Path(__file__).resolve().parents[1]
OFFICIAL_BASE = "nvidia/cuda:13.0.1-base-ubuntu24.04"  # Dockerfile.cuda's default BASE_IMAGE
STANDIN = "localhost/hybrid-search-base"
IMAGE = "localhost/hybrid-search:cuda"
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
UBUNTU_KEY = "F6ECB3762474EDA9D21B7022871920D1991BC93C"  # Ubuntu Archive Automatic Signing Key (2018)
UBUNTU_KEYRING_DEB = "http://archive.ubuntu.com/ubuntu/pool/main/u/ubuntu-keyring/ubuntu-keyring_2023.11.28.1_all.deb"

# Runs in .venv-a2a03 (a2a-sdk 0.3): the NFCorpus evaluator's way of asking, one JSON line a query.
A2A03_CLIENT = r"""
import asyncio, json, sys, time, uuid
import httpx
from a2a.client import A2ACardResolver, ClientConfig, ClientFactory
from a2a.types import Message, Part, Role, Task, TextPart

def text_of(part):
    root = part.root
    return root.text if root.kind == "text" else json.dumps(root.data) if root.kind == "data" else ""

async def main(url, top_k, queries):
    async with httpx.AsyncClient(timeout=60) as http:
        card = await A2ACardResolver(http, url).get_agent_card()  # /.well-known/agent-card.json
        print(json.dumps({"card": {"name": card.name, "url": card.url}}), flush=True)
        client = ClientFactory(ClientConfig(httpx_client=http, streaming=False)).create(card)
        for qid, text in queries:
            started = time.perf_counter()
            try:
                message = Message(role=Role.user, message_id=uuid.uuid4().hex,
                                  parts=[Part(root=TextPart(text=json.dumps({"query": text, "top_k": top_k})))])
                task = None
                async for event in client.send_message(message):
                    task = event[0] if isinstance(event, tuple) else event
                assert isinstance(task, Task), f"expected a task, got {type(task).__name__}"
                parts = list(task.status.message.parts) if task.status.message else []
                parts += [p for a in task.artifacts or [] for p in a.parts]
                doc_ids = json.loads("".join(text_of(p) for p in parts))["doc_ids"]
                out = {"qid": qid, "doc_ids": [str(d) for d in doc_ids]}
            except Exception as exc:
                out = {"qid": qid, "error": f"{type(exc).__name__}: {exc}"}
            out["seconds"] = time.perf_counter() - started
            print(json.dumps(out), flush=True)

asyncio.run(main(sys.argv[1], int(sys.argv[2]), json.load(sys.stdin)))
"""


class Check:
    """Named outcomes, printed as they happen and saved in the report."""

    def __init__(self) -> None:
        self.results: dict[str, dict] = {}

    def record(self, name: str, ok: bool, **detail) -> bool:
        self.results[name] = {"ok": bool(ok), **detail}
        shown = ", ".join(f"{k}={v}" for k, v in detail.items() if not isinstance(v, (dict, list)))
        print(f"[{'pass' if ok else 'FAIL'}] {name}" + (f": {shown}" if shown else ""), flush=True)
        return ok


def sh(*cmd: str, check: bool = True, timeout: float | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, text=True, capture_output=True, timeout=timeout, **kw)


def podman(*args: str, check: bool = True, timeout: float | None = None) -> subprocess.CompletedProcess:
    return sh("podman", *args, check=check, timeout=timeout)


def say(message: str) -> None:
    print(f"== {message}", flush=True)


# --- podman and the base image -----------------------------------------------------------------


def configure_podman(work: Path) -> str | None:
    """A containers.conf for VMs where crun cannot run and ulimits cannot be raised; left alone when
    the caller set CONTAINERS_CONF."""
    if os.environ.get("CONTAINERS_CONF"):
        return os.environ["CONTAINERS_CONF"]
    if shutil.which("podman") is None:
        sys.exit(
            "benchmarks.container: podman is not installed (apt-get install podman runc mmdebstrap "
            "containernetworking-plugins iptables)"
        )
    conf = work / "containers.conf"
    lines = ["[containers]", 'default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]']
    if shutil.which("runc"):
        lines += ["[engine]", 'runtime = "runc"']
    conf.write_text("\n".join(lines) + "\n")
    os.environ["CONTAINERS_CONF"] = str(conf)
    return str(conf)


def _reachable(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=15) as reply:
            return reply.status == 200
    except (OSError, urllib.error.URLError):
        return False


def make_base(work: Path, wanted: str, rebuild: bool) -> dict:
    """The official base if it can be pulled, else a stand-in bootstrapped with mmdebstrap."""
    if wanted not in ("auto", "standin"):
        return {"image": wanted, "kind": "given"}
    if wanted == "auto":
        pulled = podman("pull", OFFICIAL_BASE, check=False, timeout=1800)
        if pulled.returncode == 0:
            return {"image": OFFICIAL_BASE, "kind": "official"}
        say(f"no registry answered for {OFFICIAL_BASE}; making a stand-in")
    if _reachable("http://archive.ubuntu.com/ubuntu/dists/noble/Release"):
        distro, tag = "ubuntu", "ubuntu24.04"
    else:
        distro, tag = "debian", "debian12"  # Python 3.11: also inside the project's >=3.11,<3.13
    image = f"{STANDIN}:{tag}"
    if not rebuild and podman("image", "exists", image, check=False).returncode == 0:
        return {"image": image, "kind": "stand-in", "distribution": distro, "made_seconds": None}
    if shutil.which("mmdebstrap") is None:
        sys.exit("benchmarks.container: no registry answers and mmdebstrap is not installed")
    started = time.perf_counter()
    tarball = work / f"{tag}.tar"
    if distro == "ubuntu":
        deb = work / "ubuntu-keyring.deb"
        urllib.request.urlretrieve(UBUNTU_KEYRING_DEB, deb)
        sh("dpkg-deb", "-x", str(deb), str(work / "keyring"))
        keyring = work / "keyring/etc/apt/trusted.gpg.d/ubuntu-keyring-2018-archive.gpg"
        shown = sh("gpg", "--show-keys", "--with-colons", str(keyring)).stdout
        if f"fpr:::::::::{UBUNTU_KEY}:" not in shown:
            sys.exit(f"benchmarks.container: {keyring} does not hold Ubuntu's archive key {UBUNTU_KEY}")
        archive, security = "http://archive.ubuntu.com/ubuntu", "http://security.ubuntu.com/ubuntu"
        sources = [
            f"deb {archive} noble main universe",
            f"deb {archive} noble-updates main universe",
            f"deb {security} noble-security main universe",
        ]
        suite, options = "noble", [f"--keyring={keyring}"]
    else:
        sources = [
            "deb http://deb.debian.org/debian bookworm main",
            "deb http://deb.debian.org/debian bookworm-updates main",
            "deb http://deb.debian.org/debian-security bookworm-security main",
        ]
        suite, options = "bookworm", []
    sh(
        "mmdebstrap",
        "--variant=minbase",
        "--include=apt",
        "--components=main,universe" if distro == "ubuntu" else "--components=main",
        *options,
        suite,
        str(tarball),
        *sources,
        timeout=1800,
    )
    podman(
        "import",
        "--change",
        "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "--change",
        'CMD ["/bin/bash"]',
        str(tarball),
        image,
    )
    tarball.unlink()
    return {
        "image": image,
        "kind": "stand-in",
        "distribution": distro,
        "made_seconds": round(time.perf_counter() - started, 1),
    }


def build_context(work: Path, worktree: bool) -> Path:
    """The committed tree (git archive HEAD), so the image is exactly the recorded commit; or the
    working tree as it is (--worktree), uncommitted edits included."""
    if worktree:
        return ROOT
    context = work / "context"
    context.mkdir()
    archive = subprocess.run(["git", "archive", "HEAD"], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(context)], input=archive, check=True)
    for path in [context, *context.rglob("*")]:  # one fixed time: buildah's COPY cache reads mtimes
        os.utime(path, (946684800, 946684800), follow_symlinks=False)
    return context


def build_image(base: str, context: Path, no_cache: bool, check: Check) -> dict:
    # docker format: OCI images cannot hold a HEALTHCHECK (podman drops it with a warning)
    args = ["build", "--format", "docker", "-f", "Dockerfile.cuda", "--build-arg", f"BASE_IMAGE={base}", "-t", IMAGE]
    if Path(CA_BUNDLE).is_file():  # used by pip in the build stage only
        args += ["-v", f"{CA_BUNDLE}:/tmp/build-ca.crt:ro"]
    if no_cache:
        args.append("--no-cache")
    started = time.perf_counter()
    log = ROOT / "build" / "container-build.log"
    log.parent.mkdir(exist_ok=True)
    with log.open("w") as out:
        done = subprocess.run(["podman", *args, "."], cwd=context, stdout=out, stderr=subprocess.STDOUT)
    seconds = round(time.perf_counter() - started, 1)
    if not check.record("build", done.returncode == 0, seconds=seconds, log=str(log.relative_to(ROOT))):
        sys.exit(f"benchmarks.container: the build failed, see {log}")
    # each build leaves the previous image and its stages untagged (~13 GB): drop those older than this build
    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - seconds - 5))
    podman("image", "prune", "-f", "--filter", f"until={since}", check=False)
    size = int(podman("image", "inspect", "--format", "{{.Size}}", IMAGE).stdout.strip())
    # the final stage: a non-root user, no compiler, no pip, no pip or apt caches
    probe = podman(
        "run",
        "--rm",
        "--entrypoint",
        "sh",
        IMAGE,
        "-c",
        "id -u; for t in gcc cc g++ make pip pip3; do command -v $t; done; "
        "ls -A /root/.cache /home/search/.cache /var/lib/apt/lists 2>/dev/null | grep -v '^partial$\\|:$'; "
        "python3 --version; grep PRETTY_NAME /etc/os-release",
        check=False,
    ).stdout.split("\n")
    uid, found = probe[0].strip(), [line for line in probe[1:-3] if line.strip()]
    check.record(
        "final image: non-root, no compiler, pip or caches",
        uid != "0" and not found,
        uid=uid,
        found=found,
        python=probe[-3].strip(),
        os=probe[-2].split("=", 1)[-1].strip('"'),
    )
    return {"seconds": seconds, "size_bytes": size, "size_gb": round(size / 1e9, 2), "no_cache": no_cache}


# --- running and waiting -------------------------------------------------------------------------


def wait_healthy(name: str, timeout: float) -> tuple[bool, float, str]:
    """Run the image's HEALTHCHECK every second until it passes, the container exits, or time runs out."""
    started = time.perf_counter()
    while time.perf_counter() - started < timeout:
        state = podman("inspect", "--format", "{{.State.Status}}", name, check=False).stdout.strip()
        if state not in ("running", "created", "configured", "initialized"):
            return False, time.perf_counter() - started, f"container {state}"
        if podman("healthcheck", "run", name, check=False).returncode == 0:
            return True, time.perf_counter() - started, "healthy"
        time.sleep(1)
    return False, time.perf_counter() - started, "timed out"


def http_json(method: str, url: str, body: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def run_container(
    name: str,
    volume: str,
    dataset: Path | None,
    ports: tuple[int, int],
    public_url: str,
    reranker: Path | None = None,
    compile_model: bool = False,
) -> None:
    podman("rm", "-f", "-t", "5", name, check=False)
    args = [
        "run",
        "-d",
        "--name",
        name,
        "-p",
        f"127.0.0.1:{ports[0]}:8000",
        "-p",
        f"127.0.0.1:{ports[1]}:9010",
        "-v",
        f"{volume}:/data/indexes",
        "-e",
        f"HYBRID_SEARCH_PUBLIC_URL={public_url}",
    ]
    if dataset is not None:
        args += ["-v", f"{dataset}:/data/dataset:ro"]
    if reranker is not None:  # as docs/container.md tells a user to mount one
        args += ["-v", f"{reranker}:/models/reranker:ro", "-e", "HYBRID_SEARCH_RERANKER=/models/reranker"]
    if compile_model:  # a CPU compiles the torch runtime only (ONNX Runtime is its default)
        args += ["-e", "HYBRID_SEARCH_RERANK_COMPILE=true", "-e", "HYBRID_SEARCH_RERANK_RUNTIME=torch"]
    podman(*args, IMAGE)


def reranker_checks(health: dict, compile_model: bool, check: Check) -> None:
    """The mounted reranker serves; compiling forced on in an image without a compiler leaves it
    eager, and /health says why."""
    plan = health.get("reranker_plan") or {}
    check.record("reranker mounted: serving", bool(health.get("reranker")), reranker=health.get("reranker"))
    if compile_model:
        state = str(plan.get("compile", ""))
        check.record(
            "compile forced, no compiler in the image: serves eager, /health says why",
            state.startswith("eager: compiling failed"),
            compile=state,
        )


def fresh_volume(volume: str) -> None:
    podman("volume", "rm", "-f", volume, check=False)
    podman("volume", "create", volume)


# --- the checks through the published ports ----------------------------------------------------


def a2a_eval(a2a_url: str, dataset_dir: Path, n: int, seed: int, top_k: int, check: Check) -> dict:
    from offline.dataset import load_dataset
    from offline.evaluation import evaluate_run, in_list_ndcg, sample_queries

    python = ROOT / ".venv-a2a03/bin/python"
    if not python.exists():
        subprocess.run(["python3", "-m", "venv", str(ROOT / ".venv-a2a03")], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "a2a-sdk[http-server]==0.3.26"], check=True)
    dataset = load_dataset(dataset_dir)
    qrels = dataset.qrels("dev")
    queries = sample_queries(dataset.split_queries("dev"), n, seed)
    done = subprocess.run(
        [str(python), "-c", A2A03_CLIENT, a2a_url, str(top_k)],
        input=json.dumps(list(queries.items())),
        text=True,
        capture_output=True,
        timeout=3600,
    )
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    card = next((line["card"] for line in lines if "card" in line), None)
    replies = [line for line in lines if "qid" in line]
    answers = {r["qid"]: r["doc_ids"] for r in replies if "doc_ids" in r}
    failures = {r["qid"]: r["error"] for r in replies if "error" in r}
    failures.update({q: "no reply" for q in queries if q not in answers and q not in failures})
    seconds = sorted(r["seconds"] for r in replies)
    scores = evaluate_run(qrels, answers) if answers else {}
    ndcg10 = scores.get("nDCG@10", 0.0) * len(answers) / len(queries)  # a failure scores 0
    in_list = [in_list_ndcg([qrels[q].get(d, 0) for d in answers[q][:5]]) if q in answers else 0.0 for q in queries]
    result = {
        "client": "a2a-sdk 0.3.26: text part {query, top_k} JSON, non-streaming, card at /.well-known/agent-card.json",
        "card": card,
        "queries": len(queries),
        "seed": seed,
        "top_k": top_k,
        "failures": len(failures),
        "failure_examples": dict(list(failures.items())[:3]),
        "nDCG@10": round(ndcg10, 4),
        "in-list NDCG@5": round(sum(in_list) / len(in_list), 4),
        "latency_ms": {
            "p50": round(1000 * seconds[len(seconds) // 2], 1),
            "p95": round(1000 * seconds[min(len(seconds) - 1, int(0.95 * len(seconds)))], 1),
        }
        if seconds
        else None,
    }
    if done.returncode != 0:
        result["client_error"] = done.stderr[-2000:]
    check.record(
        "A2A 0.3 client, dev queries",
        done.returncode == 0
        and not failures
        and len(answers) == n
        and card is not None
        and card["url"].rstrip("/") == a2a_url.rstrip("/"),
        queries=len(queries),
        failures=len(failures),
        nDCG_10=result["nDCG@10"],
        p50_ms=(result["latency_ms"] or {}).get("p50"),
        card_url=card and card["url"],
    )
    return result


def mcp_check(mcp_url: str, check: Check, name: str = "MCP client, search_nfcorpus") -> None:
    from mcp import Client

    async def call():
        async with Client(mcp_url) as client:
            tools = [t.name for t in (await client.list_tools()).tools]
            result = await client.call_tool("search_nfcorpus", {"query": "does vitamin D prevent falls?", "top_k": 3})
            return tools, result.structured_content

    try:
        tools, content = asyncio.run(call())
        hits = (content or {}).get("results", [])
        check.record(name, len(hits) == 3, tools=tools, first=hits[0]["doc_id"] if hits else None)
    except Exception as exc:  # reported, not raised: the other checks still run
        check.record(name, False, error=f"{type(exc).__name__}: {exc}")


def rest_checks(base: str, doc_id: str, check: Check) -> None:
    status, body = http_json("POST", f"{base}/search_nfcorpus", {"query": "does vitamin D prevent falls?", "top_k": 3})
    check.record("REST search_nfcorpus", status == 200 and len(body.get("results", [])) == 3, status=status)
    document = {
        "document_id": doc_id,
        "document_name": "container check.md",
        "metadata": {"document_type": "guideline", "date": "2024-05-01"},
        "chunks": [
            {
                "chunk_id": "p1",
                "content": "Zebrafish oatmeal trials in containers show durable volumes.",
                "metadata": {"page": 1},
            }
        ],
    }
    status, ack = http_json("POST", f"{base}/documents?refresh=wait_for", document)
    check.record("REST document written", status in (200, 201), status=status)
    read_back(base, doc_id, check, "REST document read back")


# run inside the container (the agent protocol serves loopback clients only): ``send`` a retrieval
# message through the router and print its trace id, or print the ids of the traces kept
IN_CONTAINER = """
import json, sys, urllib.request
def call(path, body=None):
    data = json.dumps(body).encode() if body is not None else None
    headers = {"content-type": "application/json"}
    request = urllib.request.Request("http://127.0.0.1:8000" + path, data=data, headers=headers)
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.loads(reply.read())
if sys.argv[1] == "send":
    message = {"type": "RETRIEVAL_REQUEST", "sender": "System", "receiver": "RetrievalAgent",
               "payload": {"query": "does vitamin D prevent falls?", "top_k": 2}}
    print(call("/v1/messages", message)["trace_id"])
else:
    print(json.dumps([t["trace_id"] for t in call("/v1/traces?limit=500")["traces"]]))
"""


def traced(name: str, what: str) -> str:
    """The agent protocol inside container ``name``: ``send`` a message (its trace id) or the trace ids kept."""
    return podman("exec", name, "python3", "-c", IN_CONTAINER, what, check=False).stdout.strip()


def read_back(base: str, doc_id: str, check: Check, name: str) -> None:
    status, body = http_json("GET", f"{base}/documents/{doc_id}")
    got = status == 200 and body.get("document_id") == doc_id
    status_s, found = http_json("POST", f"{base}/search", {"query": "zebrafish oatmeal containers", "top_k": 3})
    top = [r.get("document_id") for r in found.get("results", [])]
    check.record(name, got and doc_id in top, status=status, searched_top=top[:1])


# --- the scenario ---------------------------------------------------------------------------------


def failure_case(name: str, dataset: Path | None, check: Check, label: str) -> None:
    """A fresh volume and a bad dataset: the container must exit non-zero with a clear message."""
    volume = f"{name}-index"
    fresh_volume(volume)
    podman("rm", "-f", name, check=False)
    args = ["run", "-d", "--name", name, "-v", f"{volume}:/data/indexes"]
    if dataset is not None:
        args += ["-v", f"{dataset}:/data/dataset:ro"]
    started = time.perf_counter()
    podman(*args, IMAGE)
    waited = podman("wait", name, check=False, timeout=600).stdout.strip()
    seconds = round(time.perf_counter() - started, 1)
    logs = podman("logs", name, check=False)
    text = logs.stdout + logs.stderr
    message = [line for line in text.splitlines() if line.startswith("hybrid-search: error:")]
    restarts = podman("inspect", "--format", "{{.RestartCount}}", name, check=False).stdout.strip()
    check.record(
        label,
        waited not in ("", "0") and bool(message) and "Traceback" not in text and restarts in ("", "0"),
        exit_code=waited,
        seconds=seconds,
        restarts=restarts,
        message=message[-1] if message else None,
    )
    podman("rm", "-f", name, check=False)
    podman("volume", "rm", "-f", volume, check=False)


def corrupt_copy(dataset: Path, work: Path) -> Path:
    target = work / "corrupt-dataset"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(dataset, target)
    with (target / "corpus.jsonl").open("a") as corpus:
        corpus.write('{"_id": "broken", "title": "cut off mid-line\n')
    return target


def compose_checks(args, work: Path, volume: str, check: Check, report: dict) -> None:
    compose = shutil.which("podman-compose")
    if compose is None:
        venv = work / "compose-venv"
        if not (venv / "bin/podman-compose").exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            subprocess.run([str(venv / "bin/pip"), "install", "-q", "podman-compose==1.6.0"], check=True)
        compose = str(venv / "bin/podman-compose")
    env = {
        **os.environ,
        "HS_DATASET": str(args.dataset),
        "HS_INDEX_VOLUME": volume,
        "HS_MCP_PORT": str(args.mcp_port),
        "HS_A2A_PORT": str(args.a2a_port),
        "HS_PUBLIC_URL": f"http://127.0.0.1:{args.a2a_port}",
    }
    base = [compose, "-f", str(ROOT / "compose.yaml"), "-p", "hscheck"]
    version = subprocess.run([compose, "--version"], text=True, capture_output=True).stdout.strip().splitlines()
    up = subprocess.run([*base, "up", "-d", "--no-build"], env=env, text=True, capture_output=True, cwd=ROOT)
    if not check.record("compose up", up.returncode == 0, tool=version[-1] if version else compose):
        report["compose_error"] = (up.stdout + up.stderr)[-2000:]
        return
    name = "hscheck_hybrid-search_1"
    names = podman("ps", "--filter", "label=io.podman.compose.project=hscheck", "--format", "{{.Names}}").stdout.split()
    name = names[0] if names else name
    ok, seconds, why = wait_healthy(name, 900)
    check.record("compose healthy (volume reused)", ok, seconds=round(seconds, 1), state=why)
    if ok:
        status, card = http_json("GET", f"http://127.0.0.1:{args.a2a_port}/.well-known/agent-card.json")
        check.record(
            "compose A2A card on the A2A port",
            status == 200 and card.get("url", "").startswith(env["HS_PUBLIC_URL"]),
            url=card.get("url"),
        )
        status, body = http_json(
            "POST", f"http://127.0.0.1:{args.mcp_port}/search_nfcorpus", {"query": "vitamin D", "top_k": 2}
        )
        check.record("compose REST on the MCP port", status == 200 and len(body.get("results", [])) == 2, status=status)
        mcp_check(f"http://127.0.0.1:{args.mcp_port}/mcp", check, "compose MCP client")
    down = subprocess.run([*base, "down"], env=env, text=True, capture_output=True, cwd=ROOT)
    check.record("compose down", down.returncode == 0)


def main(argv: list[str] | None = None) -> int:
    p = options.parser(__doc__, output="container.json", prog="python -m benchmarks.container")
    p.add_argument("--dataset", type=Path, default=ROOT.parent / "shared/datasets/nfcorpus", help="BEIR dataset folder")
    p.add_argument(
        "--base",
        default="auto",
        help="base image; 'auto': the official one if it pulls, else a stand-in; 'standin': always the stand-in",
    )
    p.add_argument("--rebuild-base", action="store_true", help="make the stand-in again even if present")
    p.add_argument("--no-cache", action="store_true", help="build every layer again")
    p.add_argument("--worktree", action="store_true", help="build the working tree (default: the commit, HEAD)")
    p.add_argument("--queries", type=int, default=100, help="dev queries sent through A2A (default 100)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--top-k", type=int, default=10)
    p.add_argument("--mcp-port", type=int, default=18000, help="host port published for 8000 (default 18000)")
    p.add_argument("--a2a-port", type=int, default=19010, help="host port published for 9010 (default 19010)")
    p.add_argument("--volume", default="hs-check-index", help="the named index volume (made fresh)")
    p.add_argument("--compose", action="store_true", help="also bring compose.yaml up with podman-compose")
    p.add_argument(
        "--reranker", type=Path, help="a reranker folder mounted read-only at /models/reranker (default: none)"
    )
    p.add_argument(
        "--rerank-compile",
        action="store_true",
        help="with --reranker: compiling forced on (the torch runtime), to show the image serves eager without a"
        " compiler and says why in /health",
    )
    args = p.parse_args(argv)
    if args.rerank_compile and args.reranker is None:
        p.error("--rerank-compile needs --reranker")
    args.reranker = args.reranker.resolve() if args.reranker else None
    args.dataset = args.dataset.resolve()
    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="hybrid-search-container-"))
    work.chmod(0o755)  # mmdebstrap's apt reads the keyring in it as its sandbox user, not as root
    check = Check()
    inputs = ["Dockerfile.cuda", ".dockerignore", "compose.yaml", "pyproject.toml", "README.md"]
    inputs += ["engine", "index_build", "agents", "serving", "benchmarks"]
    dirty = sh("git", "status", "--porcelain", "--", *inputs, cwd=ROOT).stdout.split("\n")
    dirty = [line for line in dirty if line.strip() and "benchmarks/results" not in line]
    report: dict = {
        "build_context": "the working tree" if args.worktree else "git archive HEAD",
        "uncommitted_changes": dirty if args.worktree else "not in the image",
        "host_cpus": os.cpu_count(),
    }
    report["podman"] = {"version": podman("--version").stdout.strip(), "containers_conf": configure_podman(work)}

    say("base image")
    report["base"] = make_base(work, args.base, args.rebuild_base)
    say(f"building {IMAGE} from {report['base']['image']}")
    report["image"] = {
        "name": IMAGE,
        **build_image(report["base"]["image"], build_context(work, args.worktree), args.no_cache, check),
    }

    name, mcp, a2a = "hs-check", f"http://127.0.0.1:{args.mcp_port}", f"http://127.0.0.1:{args.a2a_port}"
    say(f"first start: fresh volume {args.volume}, dataset {args.dataset} read-only (builds the index)")
    fresh_volume(args.volume)
    run_container(
        name, args.volume, args.dataset, (args.mcp_port, args.a2a_port), a2a, args.reranker, args.rerank_compile
    )
    ok, seconds, why = wait_healthy(name, 1800)
    report["time_to_healthy_s"] = {"first_start_with_index_build": round(seconds, 1)}
    if not check.record("first start healthy", ok, seconds=round(seconds, 1), state=why):
        logs = podman("logs", "--tail", "40", name, check=False)
        report["logs"] = (logs.stdout + logs.stderr)[-4000:]
    else:
        status, health = http_json("GET", f"{mcp}/health")
        report["health"] = health
        if args.reranker is not None:
            reranker_checks(health, args.rerank_compile, check)
        say(f"A2A: {args.queries} dev queries through {a2a}")
        report["a2a"] = a2a_eval(a2a, args.dataset, args.queries, args.seed, args.top_k, check)
        mcp_check(f"{mcp}/mcp", check)
        doc_id = f"container-check-{int(time.time())}"
        rest_checks(mcp, doc_id, check)
        trace_id = traced(name, "send")
        check.record("agent protocol message traced", trace_id in traced(name, "list"), trace_id=trace_id)
        manifest = podman("exec", name, "cat", "/data/indexes/nfcorpus/manifest.json", check=False).stdout

        say("podman stop (SIGTERM), then start again on the same volume")
        stop_started = time.perf_counter()
        podman("stop", "-t", "60", name, check=False)
        stop_seconds = round(time.perf_counter() - stop_started, 1)
        code = podman("inspect", "--format", "{{.State.ExitCode}}", name).stdout.strip()
        logs = podman("logs", name, check=False)
        check.record(
            "stop: SIGTERM drains and exits 0", code == "0" and stop_seconds < 60, exit_code=code, seconds=stop_seconds
        )
        report["stop_log_tail"] = (logs.stdout + logs.stderr).splitlines()[-3:]
        podman("start", name)
        ok, seconds, why = wait_healthy(name, 900)
        report["time_to_healthy_s"]["restart_volume_reused"] = round(seconds, 1)
        check.record("restart healthy", ok, seconds=round(seconds, 1), state=why)
        if ok:
            again = podman("exec", name, "cat", "/data/indexes/nfcorpus/manifest.json", check=False).stdout
            restart_logs = podman("logs", name, check=False)  # both starts
            builds = (restart_logs.stdout + restart_logs.stderr).count("BM25 index: done")  # the build's log
            kept = traced(name, "list")
            check.record("restart: the message traces kept on the volume", bool(trace_id) and trace_id in kept)
            built_at = [json.loads(m or "{}").get("built_at") for m in (manifest, again)]
            check.record(
                "restart: index volume reused, no rebuild",
                built_at[0] is not None and built_at[0] == built_at[1] and builds == 1,
                seconds=round(seconds, 1),
                built_at=built_at[1],
                index_builds_logged=builds,
            )
            read_back(mcp, doc_id, check, "restart: written document still there")
        podman("stop", "-t", "60", name, check=False)

        if args.compose:
            say("compose.yaml with podman-compose, on the same index volume")
            compose_checks(args, work, args.volume, check, report)
        podman("rm", "-f", name, check=False)

    say("bad datasets: missing mount, corrupt corpus (fresh volumes)")
    failure_case("hs-check-missing", None, check, "missing dataset mount: clear message, non-zero exit")
    failure_case(
        "hs-check-corrupt", corrupt_copy(args.dataset, work), check, "corrupt dataset: clear message, non-zero exit"
    )

    report["checks"] = check.results
    report["passed"] = all(c["ok"] for c in check.results.values())
    report["total_seconds"] = round(time.perf_counter() - started, 1)
    write_result(args.output, report, vars(args))
    shutil.rmtree(work, ignore_errors=True)
    failed = [n for n, c in check.results.items() if not c["ok"]]
    print(
        f"{len(check.results) - len(failed)}/{len(check.results)} checks passed in {report['total_seconds']:.0f} s"
        f"{'; failed: ' + ', '.join(failed) if failed else ''}; report: {args.output}"
    )
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
