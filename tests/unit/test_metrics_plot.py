"""MetricLogger backends (console, jsonl, wandb offline, tensorboard) and distflow.metrics.plot."""

import glob
import io
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distflow.config import DistflowConfig, LoggingConfig, config_record
from distflow.metrics.loggers import MetricLogger
from distflow.metrics.plot import read_metrics, write_plots
from distflow.run.rundir import RunDir

ROOT = Path(__file__).resolve().parents[2]


def _row(step: int, **extra) -> dict:
    return {
        "step": step, "reward/mean": 0.25 * step, "response_length/mean": 10.0 + step, "response_length/max": 16.0,
        "timing/generate_s": 1.0, "timing/reward_s": 0.1, "timing/logprob_s": 0.3, "timing/update_s": 0.8,
        "timing/sync_s": 0.2, "timing/probe_s": 0.05, "timing/step_s": 2.6, "throughput/tokens_per_s": 100.0 * step,
        **extra,
    }


def _read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


@pytest.fixture
def output_channel(tmp_path):
    """The run's output channel (distflow.run.output), as the trainer sets it up on rank 0."""
    from distflow.run.output import reset_output, setup_output

    setup_output(tmp_path / "channel" / "rank_0.log", rank=0)
    yield
    reset_output()


def logging_cfg(*loggers: str, progress_bar: bool = False, project: str = "distflow",
                every_s: float = 0.0) -> LoggingConfig:
    return LoggingConfig(loggers=list(loggers or ("console", "jsonl")), progress_bar=progress_bar,
                         wandb_project=project, progress_every_s=every_s)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_jsonl_keeps_the_resumed_steps_and_console_prints_on_main_only(tmp_path, capsys, output_channel):
    out = RunDir(tmp_path / "run")
    MetricLogger(out, False, 3, logging_cfg(), {}).log(_row(1))  # rank 1: nothing at all
    assert not out.root.exists()
    logger = MetricLogger(out, True, 3, logging_cfg(), {})
    for s in (1, 2, 3):
        logger.log(_row(s))
    logger.close()
    logger.close()  # idempotent
    assert [r["step"] for r in _read_jsonl(out.metrics)] == [1, 2, 3]
    text = capsys.readouterr().out
    assert "step 2/3 | reward 0.500 | step 2.6s | eta" in text and "step 3/3" in text
    # a run resumed from step 2 keeps the rows up to its checkpoint (step 3 was logged after it by the
    # run that died) and appends its own
    logger = MetricLogger(out, True, 4, logging_cfg(), {}, resumed_step=2)
    logger.log(_row(3, **{"reward/mean": 9.0}))
    logger.close()
    assert [(r["step"], r["reward/mean"]) for r in _read_jsonl(out.metrics)] == [(1, 0.25), (2, 0.5), (3, 9.0)]
    # a fresh start writes the file anew
    MetricLogger(out, True, 3, logging_cfg(), {}).close()
    assert out.metrics.read_text() == ""


def test_console_progress_bar_shows_step_reward_and_resumes_mid_run(tmp_path, monkeypatch, output_channel):
    monkeypatch.setattr(sys, "stderr", terminal := _Terminal())  # tqdm draws on stderr
    logger = MetricLogger(RunDir(tmp_path), True, 10, logging_cfg("console", progress_bar=True), {})
    logger.log(_row(4))  # a resumed run: the bar starts at step 4 of 10
    logger.close()
    text = terminal.getvalue()
    assert "4/10" in text and "reward=1.000" in text and "\r" in text  # a bar, redrawn in place
    assert not (tmp_path / "metrics.jsonl").exists()  # jsonl not chosen


def test_without_a_terminal_the_bar_becomes_plain_throttled_lines(tmp_path, capsys, monkeypatch, output_channel):
    """Into a file or a pipe (capsys: not a terminal) the bar asked for is plain lines, no carriage
    returns, log lines each on their own line; between the first and the last step at most one
    line per progress_every_s."""
    clock = iter([0.0, 1.0, 2.0, 5.0, 12.0, 13.0, 30.0])  # the logger's start, then one reading per step
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    logger = MetricLogger(RunDir(tmp_path), True, 6, logging_cfg("console", progress_bar=True, every_s=10.0), {})
    for s in range(1, 7):
        logger.log(_row(s))
        logging.getLogger("distflow").info(f"after step {s}")
    logger.close()
    out, err = capsys.readouterr()
    assert "\r" not in out + err
    lines = out.splitlines()
    shown = [int(line.split()[1].split("/")[0]) for line in lines if line.startswith("step ")]
    assert shown == [1, 4, 6]  # step 1; step 4, 11 s after it; step 6, the last
    assert [line for line in lines if "after step" in line] == [f"distflow: after step {s}" for s in range(1, 7)]
    assert "step 4/6 | reward 1.000 | step 2.6s | eta 00:00:06" in lines  # 12 s for 4 steps, 2 left


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    for var, sub in (("WANDB_DIR", "wandb_env"), ("WANDB_CACHE_DIR", "wandb_cache"),
                     ("WANDB_CONFIG_DIR", "wandb_config"), ("WANDB_DATA_DIR", "wandb_data")):
        monkeypatch.setenv(var, str(tmp_path / sub))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def _wait_for_bytes(path: Path, needles, timeout: float = 60.0) -> bytes:
    """wandb's service writes the offline .wandb file shortly after run.finish() returns."""
    deadline = time.monotonic() + timeout
    while True:
        data = path.read_bytes() if path.exists() else b""
        if all(n in data for n in needles) or time.monotonic() > deadline:
            return data
        time.sleep(0.2)


def test_all_loggers_at_once_wandb_offline_and_tensorboard(tmp_path, wandb_offline):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    cfg = DistflowConfig()
    cfg.logging = logging_cfg("console", "jsonl", "wandb", "tensorboard", project="distflow-test")
    logger = MetricLogger(RunDir(out), True, 3, cfg.logging, config_record(cfg))
    for s in (1, 2, 3):
        logger.log(_row(s))
    logger.close()

    assert len(_read_jsonl(out / "metrics.jsonl")) == 3
    # wandb: an offline run folder inside output_dir, its id kept for resumption, keys and config inside
    run_id = (out / "wandb_run_id").read_text().strip()
    runs = glob.glob(str(out / "wandb" / f"offline-run-*-{run_id}"))
    assert len(runs) == 1, os.listdir(out / "wandb")
    needles = (b"reward/mean", b"timing/step_s", b"throughput/tokens_per_s", b"sync_bucket_mib", b"distflow-test")
    data = _wait_for_bytes(Path(runs[0], f"run-{run_id}.wandb"), needles)
    for needle in needles:
        assert needle in data, needle
    # tensorboard: one event file under output_dir/tb with every scalar at every step
    events = glob.glob(str(out / "tb" / "events.out.tfevents.*"))
    assert len(events) == 1
    acc = EventAccumulator(str(out / "tb"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"reward/mean", "response_length/max", "timing/generate_s", "throughput/tokens_per_s"} <= set(tags)
    assert "step" not in tags
    rew = acc.Scalars("reward/mean")
    assert [e.step for e in rew] == [1, 2, 3]
    assert [e.value for e in rew] == pytest.approx([0.25, 0.5, 0.75])

    # a resumed run continues the same W&B run id
    logger = MetricLogger(RunDir(out), True, 4, logging_cfg("wandb"), {}, resumed_step=3)
    logger.log(_row(4))
    logger.close()
    assert (out / "wandb_run_id").read_text().strip() == run_id
    assert len(glob.glob(str(out / "wandb" / f"offline-run-*-{run_id}"))) >= 1
    assert not glob.glob(str(tmp_path / "wandb_env" / "**" / "*.wandb"), recursive=True)


def test_non_main_rank_with_every_logger_touches_nothing(tmp_path, wandb_offline):
    logger = MetricLogger(RunDir(tmp_path / "run"), False, 3, logging_cfg("console", "jsonl", "wandb", "tensorboard"),
                          {})
    logger.log(_row(1))
    logger.close()
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- plot
PANELS = ["reward", "response length", "step time", "throughput"]
PHASE_LABELS = ["generate", "reward", "logprob", "update", "sync", "probe", "other"]


def _assert_png(path, size: tuple[int, int] | None = None):
    """A real, decodable picture with something drawn on it (not a blank canvas); `size` is
    (width, height) in pixels when known."""
    import numpy as np
    from matplotlib.image import imread

    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    img = imread(path)
    assert img.ndim == 3 and img.shape[2] in (3, 4), img.shape
    h, w = img.shape[:2]
    if size is not None:
        assert (w, h) == size, (img.shape, size)
    assert 300 <= w <= 5000 and 300 <= h <= 5000, img.shape
    rgb = np.round(img[..., :3] * 255).astype(np.int64)
    inked = (rgb < 250).any(axis=-1).mean()  # share of pixels that are not (near) white
    assert 0.01 < inked < 0.9, inked
    colours = np.unique(rgb[..., 0] * 65536 + rgb[..., 1] * 256 + rgb[..., 2]).size
    assert colours > 20, colours  # lines, fills, text: not a flat image


@pytest.fixture
def drawn(monkeypatch):
    """Every matplotlib Figure saved during the test (write_plots builds its own Figure)."""
    from matplotlib.figure import Figure

    figures, real = [], Figure.savefig

    def savefig(self, *args, **kwargs):
        figures.append(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return figures


def _panels(figures) -> dict:
    """{title: Axes} of the one figure drawn; checks the four panels in their 2x2 order."""
    assert len(figures) == 1, figures
    axes = figures[0].axes
    assert [ax.get_title() for ax in axes] == PANELS
    return dict(zip(PANELS, axes))


def _pixel_size(fig) -> tuple[int, int]:
    w, h = fig.get_size_inches() * fig.dpi
    return round(w), round(h)


def _lines(ax) -> dict:
    """{label: (xs, ys)} of the labelled lines of a panel (axhlines are unlabelled)."""
    return {ln.get_label(): (list(map(float, ln.get_xdata())), list(map(float, ln.get_ydata())))
            for ln in ax.get_lines() if not ln.get_label().startswith("_")}


def _texts(ax) -> list[str]:
    return [t.get_text() for t in ax.texts]


def test_plot_full_run_with_validation_and_summary(tmp_path, drawn):
    import numpy as np

    wait = {"timing/wait_s": 0.4, "timing/wait_min_s": 0.1}
    rows = [_row(s, **wait, **({"val/pass@1": s / 20} if s % 5 == 0 else {})) for s in range(1, 21)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "summary.json").write_text(json.dumps({"heldout_pass1_before": 0.1, "heldout_pass1_after": 0.6}))
    paths = write_plots(RunDir(tmp_path))
    assert paths == [str(tmp_path / "training.png")]
    panels = _panels(drawn)
    _assert_png(paths[0], _pixel_size(drawn[0]))
    steps = [float(s) for s in range(1, 21)]

    reward = panels["reward"]
    assert _lines(reward) == {"reward/mean": (steps, [0.25 * s for s in steps])}
    labels = reward.get_legend_handles_labels()[1]
    assert labels == ["reward/mean", "val/pass@1", "heldout_pass1_before = 0.100", "heldout_pass1_after = 0.600"]
    val = reward.collections[0].get_offsets()
    assert np.allclose(val, [[5, 0.25], [10, 0.5], [15, 0.75], [20, 1.0]])
    # held-out pass@1 before (at step 0) and after (at the last step), each with a guide line
    assert [c.get_offsets().tolist() for c in reward.collections[1:]] == [[[0.0, 0.1]], [[20.0, 0.6]]]
    assert sorted(tuple(ln.get_ydata()) for ln in reward.get_lines() if ln.get_label().startswith("_")) == \
        [(0.1, 0.1), (0.6, 0.6)]
    assert reward.get_legend() is not None and not _texts(reward)

    assert _lines(panels["response length"]) == {"mean": (steps, [10.0 + s for s in steps]),
                                                 "max": (steps, [16.0] * 20)}
    timing = panels["step time"]
    # every phase, plus the unaccounted rest, and over them the waits
    assert timing.get_legend_handles_labels()[1] == PHASE_LABELS + ["wait (most)", "wait (least)"]
    assert len(timing.collections) == len(PHASE_LABELS)
    assert _lines(timing) == {"wait (most)": (steps, [0.4] * 20), "wait (least)": (steps, [0.1] * 20)}
    assert _lines(panels["throughput"]) == {"tokens/s": (steps, [100.0 * s for s in steps])}
    assert drawn[0].get_suptitle() == tmp_path.name


def test_plot_single_step_with_missing_keys(tmp_path, drawn):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5, "timing/step_s": 1.0}) + "\n")
    path = write_plots(RunDir(tmp_path))[0]
    panels = _panels(drawn)
    _assert_png(path, _pixel_size(drawn[0]))
    assert _lines(panels["reward"]) == {"reward/mean": ([1.0], [0.5])}
    # missing keys: the panel says so instead of drawing anything
    for name in ("response length", "throughput"):
        assert _lines(panels[name]) == {} and _texts(panels[name]) == ["no data"], name
    # one step is drawn as a bar: no phase was logged, so all of step_s is "other"
    timing = panels["step time"]
    bars = timing.patches
    assert timing.get_legend_handles_labels()[1] == ["other"] and len(bars) == 1
    assert bars[0].get_height() == pytest.approx(1.0)
    assert bars[0].get_x() + bars[0].get_width() / 2 == pytest.approx(1.0)  # centred on step 1


def test_plot_reader_merges_relogged_steps_and_skips_a_cut_line(tmp_path, drawn):
    import numpy as np

    lines = [_row(1), _row(2), _row(2, **{"reward/mean": 9.0}), {"step": 2, "val/pass@1": 0.5}, _row(3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + '\n{"step": 4, "rew')
    rows = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[1]["reward/mean"] == 9.0 and rows[1]["val/pass@1"] == 0.5
    path = write_plots(RunDir(tmp_path))[0]
    reward = _panels(drawn)["reward"]
    _assert_png(path, _pixel_size(drawn[0]))
    # the plot shows the merged rows: the re-logged value, the validation point, no step 4
    assert _lines(reward) == {"reward/mean": ([1.0, 2.0, 3.0], [0.25, 9.0, 0.75])}
    assert np.allclose(reward.collections[0].get_offsets(), [[2.0, 0.5]])


def test_plot_without_metrics_writes_nothing(tmp_path):
    assert write_plots(RunDir(tmp_path)) == []
    (tmp_path / "metrics.jsonl").write_text("")
    assert write_plots(RunDir(tmp_path)) == []
    assert not (tmp_path / "training.png").exists()


def test_plot_cli(tmp_path):
    cli, inproc = tmp_path / "cli" / "run", tmp_path / "inproc" / "run"  # same name: same title
    for out in (cli, inproc):
        out.mkdir(parents=True)
        (out / "metrics.jsonl").write_text("\n".join(json.dumps(_row(s)) for s in (1, 2, 3)) + "\n")
    proc = subprocess.run([sys.executable, "-m", "distflow", "plot", str(cli)], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, MPLBACKEND="TkAgg"))  # the Agg canvas is used regardless
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(cli / "training.png")
    _assert_png(cli / "training.png")
    # the CLI draws exactly what write_plots draws from the same metrics (checked panel by panel above)
    import numpy as np
    from matplotlib.image import imread

    assert write_plots(RunDir(inproc)) == [str(inproc / "training.png")]
    assert np.array_equal(imread(cli / "training.png"), imread(inproc / "training.png"))
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = subprocess.run([sys.executable, "-m", "distflow", "plot", str(empty)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1 and "no metrics" in proc.stderr
