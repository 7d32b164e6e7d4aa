"""Two processes (torchrun, gloo on the CPU, one thread each) against one process with the same global batch."""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest
from safetensors.torch import load_file

from helpers import ROOT, chat_file
from lora_llama.cli import main

pytestmark = pytest.mark.distributed
SLOW = pytest.mark.slow  # `make test-slow`: the variants beyond one of each kind
RECIPE = str(ROOT / "recipes" / "smollm2-chat-cpu.yaml")
# examples of clearly different lengths, so padding differs between one batch of 4 and two of 2.
# lr 1e-3: Adam turns float-order noise in near-zero gradients into steps of about lr (3e-5 at lr 1e-2)
QA = [
    ("hi", "hello"),
    ("what is the capital of france", "paris is"),
    ("to be", "or not to be, that is the question"),
    ("the", "fox"),
    ("how are you today", "i am fine, thank you"),
    ("the lazy", "dog"),
    ("hello", "world"),
    ("that is", "the question of the day"),
    ("quick", "brown fox jumps over the lazy dog"),
    ("a", "b"),
    ("what is the question", "to be or not"),
    ("where", "here"),
]
COMMON = [
    "train.max_steps=6",
    "train.grad_accum=2",
    "train.warmup_steps=0",
    "train.lr=1e-3",
    "train.eval_every=3",
    "train.save_every=2",
    "data.val_size=0.25",
    "lora.r=4",
    "lora.dropout=0.0",
    "lora.targets=[q,k,v,o,gate,up,down]",
    "train.collective_timeout_s=60",
    "train.precision=fp32",
    "model.device=cpu",
]  # one process and two agree to 1e-5: float32 on gloo


@pytest.fixture
def data(tmp_path):
    return chat_file(tmp_path / "d.jsonl", QA)


def args(ckpt, data, out, batch, *extra):
    return [
        "train",
        RECIPE,
        f"model.source={ckpt}",
        f"data.source={data}",
        f"output.dir={out}",
        f"train.batch_size={batch}",
        *COMMON,
        *extra,
    ]


def torchrun(argv, script=None, timeout=240):
    """2 processes: through `lora-llama train --nproc-per-node 2`, or torchrun on a script that patches first.

    A worker that dies of SIGSEGV is run again once, from the run folder as it was before: gloo/FSDP2 on
    the CPU crashed so once in CI (rank 1 of the fsdp resume test, while rank 0 gathered a checkpoint;
    no crash in 100+ runs here). Its report (faulthandler's Python stack of each thread) is kept as a warning."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    if script is None:
        cmd = [sys.executable, "-m", "lora_llama", *argv, "--nproc-per-node", "2"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script), *argv]
    out = Path(next(a.split("=", 1)[1] for a in argv if a.startswith("output.dir=")))
    with tempfile.TemporaryDirectory() as tmp:
        before = Path(tmp) / "before"
        if out.exists():
            shutil.copytree(out, before)
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        if "Signal 11 (SIGSEGV)" in r.stderr:
            start = max(r.stderr.find("Fatal Python error"), 0)
            warnings.warn(f"a worker crashed (SIGSEGV); run again once. Its report:\n{r.stderr[start : start + 12000]}")
            shutil.rmtree(out, ignore_errors=True)
            if before.exists():
                shutil.copytree(before, out)
            r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return r.returncode, r.stdout, r.stderr


def patched_script(tmp_path, patch: str):
    path = tmp_path / "patched_train.py"
    path.write_text(f"import os, sys, signal\n{patch}\nfrom lora_llama.cli import main\nsys.exit(main(sys.argv[1:]))\n")
    return path


def rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_same_runs(one, two, keys):
    """The same steps logged in both run folders, each key within 1e-5, and adapters within 1e-5."""
    a_rows, b_rows = rows(one), rows(two)
    assert [r["step"] for r in a_rows] == [r["step"] for r in b_rows]
    for a, b in zip(a_rows, b_rows):
        for key in keys:
            if key in a:
                assert abs(a[key] - b[key]) < 1e-5, (key, a, b)
    assert close_adapters(one / "adapter", two / "adapter")


def close_adapters(a, b, tol=1e-5):
    x, y = load_file(a / "adapter_model.safetensors"), load_file(b / "adapter_model.safetensors")
    return x.keys() == y.keys() and max(float((x[k] - y[k]).abs().max()) for k in x) < tol


@pytest.mark.parametrize(
    "strategy, packing",
    [("ddp", False), pytest.param("ddp", True, marks=SLOW), ("fsdp", False), pytest.param("fsdp", True, marks=SLOW)],
)
def test_two_processes_of_batch_2_equal_one_of_batch_4(tiny_ckpt, data, tmp_path, strategy, packing):
    extra = ["data.packing=true", "data.max_seq_len=48"] if packing else []
    assert main(args(tiny_ckpt, data, tmp_path / "one", 4, *extra)) == 0
    code, out, err = torchrun(args(tiny_ckpt, data, tmp_path / "two", 2, f"train.distributed={strategy}", *extra))
    assert code == 0, err[-3000:]
    assert_same_runs(tmp_path / "one", tmp_path / "two", ("loss", "eval_loss"))
    assert f"2 processes ({strategy})" in out and out.count("eval loss") == 1  # rank 0 alone reports
    if strategy == "fsdp":  # each rank keeps half of the base's frozen weights
        held, whole = map(float, re.search(r"each rank holds ([\d.]+) MB of the base's ([\d.]+) MB", out).groups())
        assert abs(held / whole - 0.5) < 0.01, (held, whole)

    # the run folder is what one process writes
    def names(p):
        return sorted(str(f.relative_to(p)) for f in p.rglob("*") if "tensorboard" not in str(f))

    assert names(tmp_path / "one") == names(tmp_path / "two")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_killed_job_resumes_on_two_and_on_one_process(tiny_ckpt, data, tmp_path, capsys, strategy):
    def args_2(out):
        return args(tiny_ckpt, data, out, 2, f"train.distributed={strategy}")

    code, _, err = torchrun(args_2(tmp_path / "full"))
    assert code == 0, err[-3000:]
    kill = """import lora_llama.training.trainer as t
_step = t.Trainer.train_step
def step(self):
    if self.step == 5:
        os.kill(os.getpid(), signal.SIGKILL)
    return _step(self)
t.Trainer.train_step = step
"""
    code, _, _ = torchrun(args_2(tmp_path / "cut"), patched_script(tmp_path, kill))
    assert code != 0
    assert sorted(p.name for p in (tmp_path / "cut" / "checkpoints").iterdir()) == ["step-2", "step-4"]
    shutil.copytree(tmp_path / "cut", tmp_path / "cut1")
    code, _, err = torchrun(args_2(tmp_path / "cut"))  # the same command again
    assert code == 0, err[-3000:]
    assert close_adapters(tmp_path / "full" / "adapter", tmp_path / "cut" / "adapter")
    # one process continues the same global batch with batch_size 4; with 2 it would change the data order
    assert main(args(tiny_ckpt, data, tmp_path / "cut1", 2)) == 2
    assert "resume with train.batch_size=4" in capsys.readouterr().err
    assert main(args(tiny_ckpt, data, tmp_path / "cut1", 4)) == 0
    assert close_adapters(tmp_path / "full" / "adapter", tmp_path / "cut1" / "adapter")


def test_nan_on_one_rank_stops_every_rank_before_the_update(tiny_ckpt, data, tmp_path):
    nan_on_rank_1 = """import lora_llama.training.objectives as t
_loss = t.target_loss
calls = [0]
def loss(*a, **k):
    s, n = _loss(*a, **k)
    calls[0] += 1
    bad = os.environ["RANK"] == "1" and calls[0] == 7
    return (s * float("nan") if bad else s), n
t.target_loss = loss
"""
    code_file = tmp_path / "code"
    os.environ["LORA_LLAMA_EXIT_FILE"] = str(code_file)
    try:
        code, _, err = torchrun(
            args(tiny_ckpt, data, tmp_path / "run", 2, "train.eval_every=1000"), patched_script(tmp_path, nan_on_rank_1)
        )
    finally:
        del os.environ["LORA_LLAMA_EXIT_FILE"]
    assert code != 0 and code_file.read_text() == "2"  # rank 0 stopped with the one-line error, exit 2
    errors = [line for line in err.replace("\r", "\n").splitlines() if line.startswith("lora-llama train: error")]
    assert len(errors) == 1 and "non-finite loss (on another rank) at step" in errors[0]  # rank 0 speaks for the job
    step = int(errors[0].split(" at step ")[1].split(";")[0])
    ckpts = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == [f"step-{k}" for k in range(2, step, 2)]
    assert step > 2 and not (tmp_path / "run" / "adapter").exists()
    load_file(ckpts / f"step-{step - 1 - (step - 1) % 2}" / "adapter" / "adapter_model.safetensors")


def test_a_rank_that_dies_ends_the_job(tiny_ckpt, data, tmp_path):
    crash_rank_1 = """import lora_llama.training.trainer as t
_step = t.Trainer.train_step
def step(self):
    if os.environ["RANK"] == "1" and self.step == 3:
        raise RuntimeError("rank 1 fails")
    return _step(self)
t.Trainer.train_step = step
"""
    start = time.perf_counter()
    code, _, err = torchrun(args(tiny_ckpt, data, tmp_path / "run", 2), patched_script(tmp_path, crash_rank_1))
    assert code != 0 and "rank 1 fails" in err
    assert time.perf_counter() - start < 120  # not the 60 s collective timeout twice over, and never forever
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step-2"]
    assert not [p for p in (tmp_path / "run").rglob(".*") if ".tmp-" in p.name]


def test_bad_recipe_fails_before_any_process_starts(tmp_path, capsys):
    assert main(["train", RECIPE, "train.distributed=ring", "--nproc-per-node", "2"]) == 2
    err = capsys.readouterr().err
    assert "train.distributed" in err and len(err.strip().splitlines()) == 1


def test_fsdp_on_a_gguf_files_own_blocks_equals_one_process(data, tmp_path):
    """model.quantize source: each rank keeps its own rows of the file's blocks, K super-blocks and blocks of 32
    alike (q and k rows put back in HF's order first)."""
    from helpers import build_checkpoint, gguf_with_blocks
    from lora_llama.outputs.export import export_gguf

    ckpt = build_checkpoint(tmp_path / "ckpt", hidden_size=256, intermediate_size=512)
    export_gguf(str(ckpt), tmp_path / "f16.gguf", progress=False)
    gguf = gguf_with_blocks(
        tmp_path / "f16.gguf",
        tmp_path / "mixed.gguf",
        {"attn_q": "Q4_K", "attn_k": "Q6_K", "attn_v": "Q8_0", "ffn_down": "Q5_K"},
    )
    assert main(args(gguf, data, tmp_path / "one", 4, "model.quantize=source")) == 0
    code, out, err = torchrun(args(gguf, data, tmp_path / "two", 2, "train.distributed=fsdp", "model.quantize=source"))
    assert code == 0, err[-3000:]
    assert_same_runs(tmp_path / "one", tmp_path / "two", ("loss", "eval_loss"))
    held, whole = map(float, re.search(r"each rank holds ([\d.]+) MB of the base's ([\d.]+) MB", out).groups())
    assert held < 0.6 * whole, (held, whole)


def test_fsdp_refuses_an_adapted_lm_head_before_training(tiny_ckpt, data, tmp_path):
    code, _, err = torchrun(
        args(tiny_ckpt, data, tmp_path / "run", 2, "train.distributed=fsdp", "lora.targets=[q,v,lm_head]")
    )
    errors = [line for line in err.splitlines() if line.startswith("lora-llama train: error")]
    assert code == 2 and len(errors) == 1 and "lm_head is not supported" in errors[0], err[-2000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize(
    "quantize", ["int8", *(pytest.param(q, marks=SLOW) for q in ("nf4", "nf4-double", "int8-dora"))]
)
def test_fsdp_on_a_quantized_base_equals_one_process(tiny_ckpt, data, tmp_path, quantize):
    """Each rank quantizes only its own rows of the checkpoint; the result is one process's on the same base.
    DoRA needs whole weights for its magnitude: each rank loads the base whole, then shards it."""
    extra = [f"model.quantize={quantize.split('-')[0]}"] + ["model.nf4_double_quant=true"] * ("double" in quantize)
    extra += ["lora.use_dora=true"] * ("dora" in quantize)
    assert main(args(tiny_ckpt, data, tmp_path / "one", 4, *extra)) == 0
    code, out, err = torchrun(args(tiny_ckpt, data, tmp_path / "two", 2, "train.distributed=fsdp", *extra))
    assert code == 0, err[-3000:]
    assert_same_runs(tmp_path / "one", tmp_path / "two", ("loss", "eval_loss"))
    held, whole = map(float, re.search(r"each rank holds ([\d.]+) MB of the base's ([\d.]+) MB", out).groups())
    assert held < 0.6 * whole, (held, whole)


@pytest.mark.parametrize(
    "objective, strategy",
    [pytest.param("dpo", "ddp", marks=SLOW), ("dpo", "fsdp"), pytest.param("orpo", "fsdp", marks=SLOW)],
)
def test_preference_objectives_on_two_processes_equal_one(tiny_ckpt, tmp_path, objective, strategy):
    """The reference pass (adapter off, no grad) and the per-pair loss over the global batch on two ranks."""
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(
        "".join(
            json.dumps({"prompt": q, "chosen": a, "rejected": QA[(i + 5) % len(QA)][1]}) + "\n"
            for i, (q, a) in enumerate(QA)
        )
    )
    dpo = [f"train.objective={objective}", "data.format=preference", "train.lr=1e-2"]
    assert main(args(tiny_ckpt, pairs, tmp_path / "one", 4, *dpo)) == 0
    code, _, err = torchrun(args(tiny_ckpt, pairs, tmp_path / "two", 2, f"train.distributed={strategy}", *dpo))
    assert code == 0, err[-3000:]
    assert_same_runs(
        tmp_path / "one",
        tmp_path / "two",
        ("loss", "rewards/margins", "rewards/accuracies", "eval_loss", "eval_rewards/margins"),
    )
    assert any(abs(r.get("rewards/margins", 0)) > 1e-3 for r in rows(tmp_path / "one"))  # the adapter did move


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_on_localhost_equal_two_processes_of_one_node(tiny_ckpt, data, tmp_path):
    """`--nnodes 2 --node-rank R --rdzv-endpoint` (c10d rendezvous), one process a node, against one node x 2."""
    code, _, err = torchrun(args(tiny_ckpt, data, tmp_path / "one-node", 2))
    assert code == 0, err[-3000:]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    endpoint = f"localhost:{free_port()}"
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "lora_llama",
                *args(tiny_ckpt, data, tmp_path / "two-nodes", 2),
                "--nnodes",
                "2",
                "--node-rank",
                str(r),
                "--rdzv-endpoint",
                endpoint,
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    results = [(p.wait(timeout=240), *p.communicate()) for p in nodes]
    assert all(code == 0 for code, _, _ in results), [e[-2000:] for _, _, e in results]
    assert sum("2 processes (ddp)" in out for _, out, _ in results) == 1  # rank 0, on one of the nodes, reports
    assert_same_runs(tmp_path / "one-node", tmp_path / "two-nodes", ("loss", "eval_loss"))


def test_several_nodes_need_an_endpoint(tmp_path, capsys):
    assert main(["train", RECIPE, f"output.dir={tmp_path / 'run'}", "--nnodes", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--rdzv-endpoint" in err[0]


def workers_of(out: Path) -> list[int]:
    """Pids of the processes whose command line names this run folder."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(out) in (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode():
                found.append(int(proc.name))
        except OSError:  # a process that ended while we looked
            pass
    return found


@pytest.mark.slow
def test_killing_the_launcher_ends_every_worker_and_resume_is_exact(tiny_ckpt, data, tmp_path):
    """SIGKILL of `lora-llama train --nproc-per-node 2`: torchrun and both workers gone within 10 s, the run lock
    free, and `--resume` gives the uninterrupted run's adapter."""
    slow = tmp_path / "slow"  # each worker's step takes 0.5 s more, so the kill lands mid-run
    slow.mkdir()
    (slow / "sitecustomize.py").write_text(
        "import os, time\nif 'RANK' in os.environ:\n    import lora_llama.training.trainer as t\n"
        "    _step = t.Trainer.train_step\n"
        "    t.Trainer.train_step = lambda self: (time.sleep(0.5), _step(self))[1]\n"
    )

    def argv(out):
        return args(tiny_ckpt, data, out, 2, "train.max_steps=12", "train.eval_every=100")

    code, _, err = torchrun(argv(tmp_path / "full"))
    assert code == 0, err[-3000:]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{slow}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cut = tmp_path / "cut"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "lora_llama", *argv(cut), "--nproc-per-node", "2"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 180
    while not (cut / "checkpoints" / "step-4").is_dir() and launcher.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert launcher.poll() is None and len(workers_of(cut)) >= 3  # the launcher, torchrun and two workers
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 10
    while workers_of(cut) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert workers_of(cut) == []
    assert not (cut / "adapter").exists()
    code, _, err = torchrun(argv(cut) + ["--resume"])  # the lock is free: a run holding it would be refused
    assert code == 0, err[-3000:]
    full, resumed = (load_file(p / "adapter" / "adapter_model.safetensors") for p in (tmp_path / "full", cut))
    assert full.keys() == resumed.keys() and all(full[k].equal(resumed[k]) for k in full)  # bit for bit
