"""The benchmark harness's own helpers (benchmarks/moe_kernels.py), on the CPU."""

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU affinity")
def test_pin_fastest_cpu_pins_to_the_fastest_allowed_cpu():
    """In a child process (the test's own affinity stays as it is): one probe per allowed CPU, and the process
    left on the one with the smallest probe."""
    code = (
        "import json, os, sys; sys.path.insert(0, 'benchmarks'); import moe_kernels as mk; "
        "h = mk.pin_fastest_cpu(); print(json.dumps({'host': h, 'now': sorted(os.sched_getaffinity(0))}))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO / "lib")}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         check=True, timeout=300).stdout
    got = json.loads(out.strip().splitlines()[-1])
    probe = {int(c): us for c, us in got["host"]["probe_us"].items()}
    assert set(probe) == os.sched_getaffinity(0) and all(us > 0 for us in probe.values())
    assert got["now"] == [got["host"]["pinned"]] and probe[got["host"]["pinned"]] == min(probe.values())


def _ablation():
    sys.path.insert(0, str(REPO / "benchmarks"))
    import routing_ablation

    return routing_ablation


def test_sass_loop_mix_counts_the_loop_body_only():
    """Instructions between a label and the later branch back to it, by mnemonic (predicates and modifiers
    dropped); the code before the label and after the branch is not counted; a listing without a loop is an error."""
    ra = _ablation()
    sass = "\n".join([
        "Function:k",
        "--:-:0:-:1\tLDC R1, c[0x0][0x28];",
        "--:-:0:-:1\tVIMNMX R2, R3, R4, !PT;",
        "LBB0:",
        "--:-:0:-:1\tVIMNMX R2, R3, R4, !PT;",
        "--:-:0:-:1\tVIMNMX.U32 R5, R3, R4, PT;",
        "--:-:2:-:1\t@!P1 LDG.E.128 R4, desc[UR6][R14.64];",
        "--:-:0:-:1\tMUFU.EX2 R11, R11;",
        "--:-:-:-:6\t@P0 BRA LBB0;",
        "--:-:-:-:1\tSTG.E desc[UR6][R2.64], R5;",
        "LBB1:",
        "--:-:-:Y:0\tBRA LBB1;",
    ])
    assert ra.sass_loop_mix(sass) == {"VIMNMX": 2, "LDG": 1, "MUFU": 1, "BRA": 1}
    with pytest.raises(ValueError, match="no backward branch"):
        ra.sass_loop_mix("LBB0:\n--:-:-:-:1\tEXIT;\n--:-:-:-:1\tBRA LBB2;\nLBB2:")


def test_ablation_variants_patch_the_current_kernel(tmp_path):
    """Every variant's (old, new) edits apply to the routing kernel's source exactly once and the module loads, and
    `profile`'s launch comes from `_prepare` as route_triton prepares it (the kernel, its grid and arguments)."""
    import torch

    import moelab.kernels.routing as kr

    ra = _ablation()
    for name, patches in ra.VARIANTS.items():
        mod = ra.ablated(name, patches, tmp_path)
        assert mod.route_triton is not kr.route_triton
    src = {p.name: p.read_text() for p in tmp_path.iterdir()}
    assert "e = d" in src["routing_no_exp.py"] and "_sort8(k0" not in src["routing_neither.py"]
    launch, grid, scalars, meta, warps = ra.shipped_launch(kr, torch.zeros(1000, 64, dtype=torch.bfloat16), 8)
    assert launch.fn is kr._route_kernel and grid == (-(-1000 // meta["BLOCK_T"]),) and meta["POLICY"] == 0
    assert len(scalars) == 11 and warps >= 1  # fpar, seven thresholds, packed k values, k_min, statistics slots


def test_occupancy_takes_the_tightest_sm_limit():
    """Programs per SM on compute capability 9.0: registers given out per warp in 256-register units, 2048 threads,
    32 blocks, 228 KB of shared memory with 1 KB kept per block."""
    ra = _ablation()
    assert ra.occupancy(40, 2, 128) == 25  # registers: 1280 per warp -> 51 warps -> 25 two-warp programs
    assert ra.occupancy(64, 4, 256) == 8
    assert ra.occupancy(16, 1, 0) == 32  # the block limit
    assert ra.occupancy(32, 8, 0) == 8  # the thread limit: 2048 / 256
    assert ra.occupancy(32, 4, 120_000) == 1  # shared memory
    assert ra.occupancy(255, 8, 0) == 1  # 255 -> 8192 registers per warp: 8 warps


def test_tune_policies_add_the_median_plan_where_it_differs():
    """tune-gemm's plans: native top-k, the terciles policy and the median policy (k/2, k) at the median entropy;
    for k = 2 the median policy is the terciles one, so it is not timed twice."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import moe_kernels as mk
    import torch

    from moelab.routing import EntropyAdaptiveK, TopK

    ent = torch.linspace(0.0, 2.0, 101)
    pols = mk.tune_policies(ent, 8)
    assert list(pols) == ["native", "adaptive", "adaptive_q50"]
    assert pols["native"] == TopK(8) and pols["adaptive"].k_values == (2, 4, 8)
    assert pols["adaptive_q50"] == EntropyAdaptiveK((4, 8), (1.0,))
    assert list(mk.tune_policies(ent, 2)) == ["native", "adaptive"]


def test_paper_tables_resume_keeps_finished_models_and_refuses_another_protocol(tmp_path):
    """A run cut short is finished with --resume: the first run's models keep their rows (not re-run), the file
    says it was resumed and from which command, and a resume with other settings is refused naming them."""
    from moelab import results

    env = {**os.environ, "PYTHONPATH": str(REPO / "lib"), "MOELAB_RESULTS_DIR": str(tmp_path),
           "MOELAB_COMMIT": "0123abc"}  # the commit both parts name (a clean tree's; the test's may be dirty)
    small = ["--max-tokens", "256", "--cal-tokens", "256", "--budget-steps", "1", "--targets", "0.25",
             "--no-per-layer"]

    def run(*args, check=True):
        return subprocess.run([sys.executable, "benchmarks/paper_tables.py", *args], cwd=REPO, env=env,
                              capture_output=True, text=True, check=check, timeout=600)

    run("--models", "tiny-mixtral", *small)
    (out,) = tmp_path.glob("paper-tables-smoke.json")
    first = out.rename(tmp_path / "first.json")
    bad = run("--models", "tiny-mixtral,tiny-olmoe", *small[:-2], "0.3", "--resume", str(first), check=False)
    assert bad.returncode != 0 and "targets [0.25], here [0.3]" in bad.stderr and "no_per_layer" in bad.stderr
    env["MOELAB_COMMIT"] = "0123abc-dirty"
    dirty = run("--models", "tiny-mixtral,tiny-olmoe", *small, "--resume", str(first), check=False)
    assert dirty.returncode != 0 and "'0123abc-dirty'" in dirty.stderr and "clean" in dirty.stderr
    assert not list(tmp_path.glob("paper-tables-smoke.json"))
    env["MOELAB_COMMIT"] = "0123abc"
    # the same settings spelled otherwise (spaces in --targets, the default topic named) still resume
    same = [*small[:-2], "0.25 ", "--no-per-layer", "--topic", "paper-tables-smoke"]
    windows = [r.get("window_nll") for r in results.read_file(first)["rows"]]  # from its sidecar
    run("--models", "tiny-mixtral,tiny-olmoe", *same, "--resume", str(first))
    doc, old = json.loads(out.read_text()), json.loads(first.read_text())
    kept = [r.get("window_nll") for r in results.read_file(out)["rows"] if r["model"] == "tiny-mixtral"]
    assert kept == windows and windows[0]  # the resumed rows' window lists go to the new sidecar
    assert doc["models_done"] == ["tiny-mixtral", "tiny-olmoe"] and doc["complete"]
    assert [r for r in doc["rows"] if r["model"] == "tiny-mixtral"] == old["rows"]
    assert any(r["model"] == "tiny-olmoe" and r["section"] == "baseline" for r in doc["rows"])
    assert doc["resumed_from"][0]["command"] == old["command"] and doc["protocol"] == old["protocol"]
    assert doc["resumed_from"][0]["commit"] == old["commit"] == "0123abc"
    assert set(doc["weights"]) == {"tiny-mixtral", "tiny-olmoe"} and doc["weights"]["tiny-mixtral"] == old["weights"][
        "tiny-mixtral"]


def test_first_call_times_every_policy_paper_tables_runs_cold_then_warm(tmp_path):
    """benchmarks/first_call.py runs paper_tables' policy kinds (published configurations included) and lower fixed
    k, first in a process with an empty Triton cache, then in one that finds it; on the CPU the torch routing path
    compiles nothing."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "lib"), "MOELAB_RESULTS_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "benchmarks/first_call.py", "--models", "tiny-qwen-moe", "--windows", "1",
                    "--context", "32", "--device", "cpu"], cwd=REPO, env=env, check=True, capture_output=True,
                   timeout=600)
    (out,) = tmp_path.glob("first-call.json")
    rows = json.loads(out.read_text())["rows"]
    jobs = ["TopK k=4", "trtllm-default", "sdk-qwen-moe", "qwen1.5-measured", "EntropyAdaptiveK", "TopP", "RatioSkip",
            "TopK k=1", "TopK k=2", "TopK k=3"]
    assert [(r["phase"], r["job"]) for r in rows] == [(p, j) for p in ("cold", "warm") for j in jobs]
    assert all(r["compiled_first"] == r["compiled_second"] == 0 and r["first_s"] > 0 for r in rows)


def test_graph_pool_summary_recomputed_from_the_committed_arms_matches_the_file():
    """benchmarks/graph_pool.py's per-model targets, recomputed from the committed run's arm rows with today's
    limits (moelab.graphs.REUSE_PEAK_LIMIT / REUSE_SPEED_FLOOR), are the summary rows the file holds: the
    limits notebook 06 prints are the ones the committed `*_target_met` columns were judged by."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import graph_pool

    from moelab import results

    doc = results.load_results("graph-pool")
    arms = [r for r in doc["rows"] if r["arm"] != "summary"]
    committed = [r for r in doc["rows"] if r["arm"] == "summary"]
    again = graph_pool.summarise(arms)
    assert [r["model"] for r in again] == [r["model"] for r in committed] and committed
    for new, old in zip(again, committed):
        assert new.keys() == old.keys()
        for key, value in old.items():
            assert new[key] == pytest.approx(value, nan_ok=True) if isinstance(value, float) else new[key] == value, key
    # a reuse arm whose eager forward fell back to the ordinary allocator, or left bytes outside the pool,
    # meets no memory target whatever its peak (the published bug's failure mode)
    model = committed[0]["model"]
    for field, value in (("eager_fallbacks", 1), ("scratch_fraction_in_pool", 0.5)):
        bad = [dict(r, **{field: value}) if (r["model"], r["arm"]) == (model, "shared+reuse") else r for r in arms]
        assert graph_pool.summarise(bad)[0]["memory_target_met"] is False


def test_eval_text_lines_refuses_a_text_shorter_than_one_window(tmp_path):
    """--chars that encode to fewer tokens than one --context window: an error naming both, not torch.cat([])."""
    out = subprocess.run([sys.executable, "benchmarks/eval_text_lines.py", "--models", "tiny-mixtral", "--chars",
                          "1000"], cwd=REPO, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "MOELAB_RESULTS_DIR": str(tmp_path),
                              "PYTHONPATH": str(REPO / "lib") + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert out.returncode != 0 and "fewer than one window of --context 512; raise --chars" in out.stderr
    assert not list(tmp_path.glob("*.json"))


def test_patch_noise_reproduces_the_unchanged_perplexity(tmp_path):
    """benchmarks/patch_noise.py: the model's own top-k through moelab gives the unchanged perplexity (fp32 router
    probabilities without a tie at the k-th place), mean k the native 2, at every token count and batch size; in
    fp32 transformers' reference expert loop gives it too."""
    out = _run_script("patch_noise", ["--models", "tiny-mixtral", "--tokens", "2048,512", "--batches", "1,3"],
                      tmp_path)
    assert out.returncode == 0, out.stderr
    (path,) = tmp_path.glob("patch-noise.json")
    rows = json.loads(path.read_text())["rows"]
    assert [(r["tokens"], r["batch_size"]) for r in rows] == [(2048, 1), (2048, 3), (512, 1), (512, 3)]
    for r in rows:
        n = r["tokens"]
        assert r["scored_tokens"] == n - n // 512 and r["native_k"] == 2 and r["mean_k"] == 2
        assert r["dtype"] == "float32" and r["device"] == "cpu"  # the CPU default; on CUDA it is bf16 unless asked
        assert r["ties_at_k"] == 0 and r["routed_token_layers"] == n * 4
        assert abs(r["ppl_change"]) < 1e-7 and r["ppl_native_topk"] == pytest.approx(r["ppl_unchanged"], rel=1e-7)
        # the reference loop is a different expert path, not a routing change: equal in fp32 up to summation order
        assert r["experts_default"] == "grouped_mm" and r["experts_reference"] == "eager"
        assert abs(r["reference_change"]) < 1e-6 and abs(r["ppl_change_vs_reference"]) < 1e-6


BAD_ARGS = [  # (script, arguments, what the error must say): refused at parse time, before any model or GPU
    ("paper_tables", ["--max-tokens", "-5"], "argument --max-tokens: '-5': must be an int >= 2"),
    ("paper_tables", ["--batch-size", "0"], "argument --batch-size: '0': must be an int >= 1"),
    ("paper_tables", ["--stride", "0"], "argument --stride: '0': must be an int >= 1"),
    ("paper_tables", ["--budget", "-0.01"], "argument --budget: '-0.01': must be a number > 0"),
    ("paper_tables", ["--budget-steps", "-1"], "argument --budget-steps: '-1': must be an int >= 0"),
    ("paper_tables", ["--targets", "0.1,,x"], "argument --targets: .*'x' is not a number in \\(0, 1\\)"),
    ("paper_tables", ["--targets", ""], "argument --targets: '': no reduction given"),
    ("paper_tables", ["--topic", "../x"], "argument --topic: topic '../x': must be a plain file stem"),
    ("paper_tables", ["--models", "tiny-olmoe,nosuch"], "argument --models: nosuch: no such directory"),
    ("paper_tables", ["--models", ","], "argument --models: no model named"),
    ("paper_tables", ["--budget", "0"], "argument --budget: '0': must be a number > 0"),
    ("paper_tables", ["--targets", "0.2,1.0"], "argument --targets: .*'1.0' is not a number in \\(0, 1\\)"),
    ("paper_tables", ["--random-init", "--models", "nosuch"],
     "argument --models: 'nosuch': with --random-init must be one of"),
    ("eval_text_lines", ["--batch", "0"], "argument --batch: '0': must be an int >= 1"),
    ("eval_text_lines", ["--models", "tiny-olmoe,nosuch"], "argument --models: nosuch: no such directory"),
    ("eval_text_lines", ["--context", "1024"], "argument --context: 1024 is past tiny-mixtral's trained context "
                                               "\\(512 positions\\)"),
    ("eval_text_lines", ["--chars", "1000", "--context", "513"],
     "argument --context: 513 is past tiny-.*'s trained context \\(512 positions\\)"),
    ("patch_noise", ["--batches", "1,0"], "argument --batches: '1,0': must be a comma list of ints >= 1"),
    ("patch_noise", ["--tokens", "1"], "argument --tokens: '1': must be a comma list of ints >= 2"),
    ("patch_noise", ["--tokens", "512,512"], "argument --tokens: \\[512, 512\\]: a count named twice"),
    ("patch_noise", ["--models", "tiny-olmoe,nosuch"], "argument --models: nosuch: no such directory"),
    ("patch_noise", ["--models", ","], "argument --models: no model named"),
    ("patch_noise", ["--device", "xpu9"], "argument --device: device='xpu9'"),
    ("patch_noise", ["--dtype", "float32,fp8"], "argument --dtype: dtype='fp8': must be 'auto' or one of"),
    ("first_call", ["--models", "nosuch", "--device", "cpu"], "argument --models: nosuch: no such directory"),
    ("first_call", ["--device", "xpu9"], "argument --device: device='xpu9'"),
    ("first_call", ["--models", ",", "--device", "cpu"], "argument --models: no model named"),
    ("moe_kernels", ["--parts", "routng"], "argument --parts: \\['routng'\\]: must be among \\['tune', 'routing'"),
    ("moe_kernels", ["--parts", "tune-gemm", "--tune-shapes", "mixtral,x"],
     "argument --tune-shapes: \\['x'\\]: must be among"),
    ("moe_kernels", ["--tune-routing-shapes", "8:16"],
     "argument --tune-routing-shapes: '8:16': must be a comma list of E:k with ints 1 <= k <= E"),
    ("layer_stages", ["--shapes", "mixtral,olmo"], "argument --shapes: olmo: must be among"),
    ("layer_stages", ["--tokens", "4096,x"], "argument --tokens: '4096,x': must be a comma list of ints >= 1"),
    ("layer_stages", ["--gemms", "grouped,tritn"], "argument --gemms: tritn: must be among"),
    ("routing_ablation", ["--experts", "64,x"], "argument --experts: '64,x': must be a comma list of ints >= 8"),
    ("routing_ablation", ["--tokens", "0"], "argument --tokens: 0: must be an int >= 1"),
    ("pair_layout", ["--tokens", "x"], "argument --tokens: 'x': must be a comma list of ints >= 1"),
    ("graph_pool", ["--adaptive", "--adaptive-models", "tiny-olmo"],
     "argument --adaptive-models: \\['tiny-olmo'\\]: must be among --models"),
]


def _run_script(script, args, results_dir):
    env = {**os.environ, "PYTHONPATH": str(REPO / "lib"), "MOELAB_RESULTS_DIR": str(results_dir)}
    return subprocess.run([sys.executable, f"benchmarks/{script}.py", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("script,args,message", BAD_ARGS, ids=[f"{s} {' '.join(a)}" for s, a, _ in BAD_ARGS])
def test_benchmark_refuses_bad_arguments_before_any_work(tmp_path, script, args, message, monkeypatch, capfd):
    """A bad option value: argparse's exit 2 with one message naming the option and the value (no other exception,
    none from a child process), and no results file (so no model ran first, e.g. tiny-olmoe before 'nosuch'). The
    script runs as __main__ in this process (its imports are paid once for all cases)."""
    import runpy

    monkeypatch.setenv("MOELAB_RESULTS_DIR", str(tmp_path))
    monkeypatch.setattr(sys, "argv", [f"benchmarks/{script}.py", *args])
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(REPO / "benchmarks" / f"{script}.py"), run_name="__main__")
    err = capfd.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err, err
    assert re.search(message, err) and err.count("error:") == 1, err
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_ci_gpu_logs_each_step_with_machine_commit_and_command(tmp_path):
    """.ci/gpu (the GPU checks in one device call): a bad step is refused before any runs, a missing commit too;
    a step's log opens with the machine, versions, commit and command and closes with its rc (here on the CPU,
    where every CUDA test skips); more than 8 output files are packed into one archive."""
    env = {**os.environ, "OUT": str(tmp_path), "MOELAB_COMMIT": "abc1234"}

    def gpu(*steps, **extra):
        return subprocess.run(["bash", ".ci/gpu", *steps], cwd=REPO, env={**env, **extra}, capture_output=True,
                              text=True, timeout=600)

    bad = gpu("cuda-tests", "nosuch")
    assert bad.returncode == 2 and "nosuch: not a step" in bad.stdout and not list(tmp_path.iterdir())
    assert gpu("cuda-tests", MOELAB_COMMIT="").returncode != 0 and not list(tmp_path.iterdir())
    (tmp_path / "results").mkdir()
    for i in range(8):  # with the step's log, more files than the 8 the device tool brings back
        (tmp_path / "results" / f"extra-{i}.json").write_text("{}")
    ok = gpu("cuda-tests")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "9 files: packed into gpu-abc1234.tar.xz" in ok.stdout, ok.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["gpu-abc1234.tar.xz"]
    with tarfile.open(tmp_path / "gpu-abc1234.tar.xz") as tar:
        assert "results/extra-7.json" in tar.getnames()
        log = tar.extractfile("logs/cuda-tests.txt").read().decode().splitlines()
    assert re.match(r"# .* \((device tool|CPU machine, \d+ cores)\), python 3\.\d+\.\d+, torch \S+, "
                    r"triton \S+, transformers \S+, driver \S+, tree at abc1234: python -m pytest .* -m gpu ",
                    log[0]), log[0]
    assert re.fullmatch(r"# rc=0 wall=\d+ s", log[-1]) and "skipped" in log[-2]


def test_ci_gpu_take_copies_a_calls_results_into_data_results(tmp_path):
    """.ci/gpu take (here, after a device call): results/<topic>.json (and its .npz sidecar), loose or packed in
    gpu-*.tar.xz, replaces data/results/<topic>.json, or lands as <topic>-<suffix>.json (another device's run); a bad
    call writes nothing."""
    repo, out = tmp_path / "repo", tmp_path / "out"
    (repo / ".ci").mkdir(parents=True)
    (repo / ".ci" / "gpu").write_text((REPO / ".ci" / "gpu").read_text())
    (repo / "data" / "results").mkdir(parents=True)
    (repo / "data" / "results" / "moe-layer.json").write_text('{"rows": [0]}')
    (out / "results").mkdir(parents=True)
    (out / "results" / "moe-layer.json").write_text('{"rows": [1]}')
    (out / "results" / "moe-layer.npz").write_bytes(b"sidecar")  # moelab.results' lists kept apart: taken alike

    def take(*args):
        return subprocess.run(["bash", ".ci/gpu", "take", *map(str, args)], cwd=repo, capture_output=True, text=True,
                              timeout=60)

    assert take(tmp_path / "nosuch").returncode == 2 and take(out, "bad/suffix").returncode == 2
    assert take(tmp_path).returncode == 2  # no results in it
    assert take(out, "h100").returncode == 0
    assert (repo / "data" / "results" / "moe-layer-h100.json").read_text() == '{"rows": [1]}'
    assert (repo / "data" / "results" / "moe-layer-h100.npz").read_bytes() == b"sidecar"
    assert (repo / "data" / "results" / "moe-layer.json").read_text() == '{"rows": [0]}'
    packed = tmp_path / "packed"
    packed.mkdir()
    with tarfile.open(packed / "gpu-abc1234.tar.xz", "w:xz") as tar:
        tar.add(out / "results", arcname="results")
    done = take(packed)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (repo / "data" / "results" / "moe-layer.json").read_text() == '{"rows": [1]}'


@pytest.mark.skipif(not (shutil.which("make") and hasattr(os, "getuid")), reason="needs make")
def test_make_lab_starts_jupyterlab_as_root_only_with_allow_root():
    """JupyterLab exits at once as root without --allow-root (a fresh container is root): make lab passes it there,
    and only there."""
    out = subprocess.run(["make", "-n", "-o", "setup", "-o", ".setup-stamp", "lab"], cwd=REPO, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    (line,) = [ln for ln in out.splitlines() if "jupyter lab" in ln]
    assert "--no-browser" in line and "--ip=127.0.0.1" in line
    assert ("--allow-root" in line) == (os.getuid() == 0)


def test_tree_fits_the_device_tools_copy():
    """The device tool copies tracked and untracked-not-ignored files, at most 64 MiB counted in 4 KiB blocks: the
    tree leaves at least 1 MiB of it."""
    ls = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                        capture_output=True, text=True)
    if ls.returncode != 0:
        pytest.skip("not a git checkout")
    paths = [REPO / p for p in ls.stdout.split("\0") if p and (REPO / p).is_file()]
    # a symbolic link travels as a link (the models' tokenizer.json): its own size, not its target's
    blocks_mib = sum(-(-p.lstat().st_size // 4096) * 4096 for p in paths) / 2**20
    assert blocks_mib <= 63, f"the tree takes {blocks_mib:.1f} MiB in 4 KiB blocks; the device tool copies 64 at most"


def test_paper_tables_refuses_an_unwritable_results_dir_before_any_model(tmp_path):
    """MOELAB_RESULTS_DIR that cannot be written: refused at startup, not when the first model's rows are saved."""
    (tmp_path / "file").write_text("")
    out = _run_script("paper_tables", ["--models", "tiny-olmoe", "--max-tokens", "256"], tmp_path / "file" / "sub")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert re.search(r"results directory .*file/sub \(MOELAB_RESULTS_DIR\): not writable", out.stderr), out.stderr
