"""The examples run in their tiny configurations, and learn."""

import dataclasses
import json
import re
import shutil
from pathlib import Path

import chex
import numpy as np
import pytest

import zerojax
from examples import train_lm
from examples.lm import train as lm_train
from tests.helpers import ROUNDING

ROOT = Path(__file__).resolve().parent.parent
# The tiny model, without the end-of-run report (the stage-0 compile and the sample), which
# only the first test needs.
TINY = ("--model", "tiny", "--no-report")


def test_train_lm_tiny_learns_and_reports(tmp_path, capsys):
  metrics = train_lm.main(["--model", "tiny", "--steps", "20", "--out", str(tmp_path)])
  losses = metrics["train_loss"]
  assert losses[-1] < 0.8 * losses[0]
  assert json.loads((tmp_path / "metrics.json").read_text())["config"]["stage"] == 3
  assert (tmp_path / "loss.png").stat().st_size > 0
  logged = [json.loads(line) for line in (tmp_path / "losses.jsonl").read_text().splitlines()]
  assert logged == [{"step": step, "loss": loss} for step, loss in enumerate(losses, 1)]
  # The progress line README shows, with other numbers (pytest's stderr is no terminal).
  shown = re.search(r"^step 50/600: .*$", (ROOT / "README.md").read_text(), re.M).group(0)
  pattern = r"[\d,.]+".join(map(re.escape, re.split(r"\d[\d,.]*", shown)))
  printed = capsys.readouterr().out.splitlines()
  assert [line for line in printed if re.fullmatch(pattern, line)], printed
  # The report: stage 3 holds far less than stage 0's replica, and the model speaks.
  memory = metrics["memory_bytes"]
  assert memory["stage 3"]["params_and_opt_state"] < memory["stage 0"]["params_and_opt_state"] / 4
  assert metrics["sample"].startswith("def ")


def test_train_lm_fp16_micro_batches_and_quantized_communication_learn(tmp_path):
  # Every option that changes the step, at once (stage 2: the multi-axis test below).
  fp16 = ["--precision", "fp16", "--microbatches", "2"]
  quantized = ["--quantized-weights", "int8", "--quantized-gradients", "int4"]
  metrics = train_lm.main([*TINY, "--steps", "20", "--out", str(tmp_path), *fp16, *quantized])
  losses = metrics["train_loss"]
  # fp16 starts at DeepSpeed's loss scale, 2^16: the first steps overflow and
  # are skipped while the scale backs off, as they are in DeepSpeed.
  assert 0 < metrics["skipped_steps"] < 10
  assert losses[-1] < 0.8 * losses[0]
  assert len(metrics["pre_clip_grad_norm"]) == 20
  config = metrics["config"]
  assert (config["quantized_weights"], config["quantized_gradients"]) == ("int8", "int4")


def test_digits_nnx_classifies():
  from examples import digits_nnx  # scikit-learn's import: 1.5 s, for this test only

  assert digits_nnx.main(["--steps", "100"])["test_accuracy"] > 0.9


def test_train_lm_resumes_where_it_stopped(flat_tiny_run, tmp_path):
  # The flat run's four steps straight, against two steps restored from its checkpoint and
  # two more: same batches (a function of the step), same losses, bit for bit.
  straight, out = flat_tiny_run
  flags = [*TINY, "--steps", "4", "--save-every", "2", "--out", str(tmp_path)]
  shutil.copytree(out / "checkpoints" / "2", tmp_path / "resumed" / "2")
  resumed = train_lm.main([*flags, "--checkpoint-dir", str(tmp_path / "resumed"), "--resume"])
  assert resumed["first_step"] == 3
  assert resumed["train_loss"] == straight["train_loss"][2:]
  final = [zerojax.load_params(d, step=4) for d in (out / "checkpoints", tmp_path / "resumed")]
  chex.assert_trees_all_equal(*final, strict=True)
  # Resumed once more after the last step (a restart loop's extra round): nothing
  # trains, and the finished run's outputs stay as they were.
  written = (tmp_path / "metrics.json").read_text()
  again = train_lm.main([*flags, "--checkpoint-dir", str(tmp_path / "resumed"), "--resume"])
  assert again["first_step"] == 5 and again["train_loss"] == []
  assert (tmp_path / "metrics.json").read_text() == written


def test_a_resumed_run_keeps_the_schedule_its_checkpoints_started_with(tmp_path):
  # docs/checkpoints.md: the first run records its schedule; a resumed run with another
  # --steps follows it, and says so.
  args = train_lm.build_parser().parse_args(
    [*TINY, "--steps", "200", "--checkpoint-dir", str(tmp_path), "--resume"]
  )
  config = train_lm.make_config(args, multi_process=False)
  said = []
  assert lm_train.learning_rate_schedule(config, said.append) == (3e-3, 200)
  assert said == []
  lm_train.Schedule(3e-3, 200).record(tmp_path)
  lm_train.Schedule(1e-3, 50).record(tmp_path)  # recorded once, by the run that started
  longer = dataclasses.replace(config, steps=300)
  assert lm_train.learning_rate_schedule(longer, said.append) == (3e-3, 200)
  assert said == [
    "--steps 300: the learning rate follows the schedule these checkpoints started with (warmup "
    "and cosine decay over --steps 200), and stays at its final 0.0003 past it"
  ]
  fresh = dataclasses.replace(longer, resume=False)
  assert lm_train.learning_rate_schedule(fresh, said.append) == (3e-3, 300)


@pytest.fixture(scope="module")
def flat_tiny_run(tmp_path_factory):
  """Four steps of the tiny model on 8 devices of one data axis, checkpointed every two steps.

  Returns its metrics and its output directory (checkpoints in ``checkpoints/``).
  """
  out = tmp_path_factory.mktemp("flat")
  checkpoints = ["--save-every", "2", "--checkpoint-dir", str(out / "checkpoints")]
  return train_lm.main([*TINY, "--steps", "4", *checkpoints, "--out", str(out)]), out


@pytest.mark.parametrize(
  "mesh, flags",
  [
    ("replica=2,data=4", ("--stage", "2")),
    ("data=4,model=2", ()),
    ("stage=2,data=4", ("--microbatches", "4", "--schedule", "1f1b")),
    ("node=2,data=4", ("--secondary-axis", "data")),
  ],
)
def test_train_lm_on_a_multi_axis_mesh_trains_like_a_flat_one(mesh, flags, flat_tiny_run, tmp_path):
  # Hybrid sharding (at stage 2), tensor parallelism over the attention and MLP weights,
  # pipeline stages and ZeRO++'s hpZ over two nodes: the same losses as stage 3 on 8 devices of
  # one data axis, to rounding.
  metrics = train_lm.main([*TINY, "--steps", "4", "--mesh", mesh, *flags, "--out", str(tmp_path)])
  assert metrics["config"]["mesh"] == train_lm.parse_mesh(mesh)
  np.testing.assert_allclose(metrics["train_loss"], flat_tiny_run[0]["train_loss"], rtol=1e-5)


def test_train_lm_offload_changes_no_loss_and_reports_host_bytes(flat_tiny_run, tmp_path, capsys):
  # The flat run is stage 3 in fp32: --offload optimizer moves its Adam state to host memory,
  # which changes no number beyond rounding (another program).
  metrics = train_lm.main([*TINY, "--steps", "4", "--offload", "optimizer", "--out", str(tmp_path)])
  chex.assert_trees_all_close(metrics["train_loss"], flat_tiny_run[0]["train_loss"], **ROUNDING)
  out = capsys.readouterr().out
  assert "optimizer state in host memory" in out
  # --no-report: no memory table, no sample, no plot; the metrics and the loss log all the same.
  assert f"wrote {tmp_path / 'metrics.json'}\n" in out and "sample:" not in out
  assert sorted(path.name for path in tmp_path.iterdir()) == ["losses.jsonl", "metrics.json"]


@pytest.mark.parametrize(
  "stage, shape, schedule",
  [(3, {"data": 8}, None), (1, {"data": 8}, None), (3, {"stage": 2, "data": 4}, "1f1b")],
)
def test_train_lm_evaluates_and_samples_on_stored_parameters_as_on_the_whole_model(
  stage, shape, schedule
):
  # The example's evaluation and sample (zerojax.forward: each device its rows, a layer open
  # at a time) against the same functions on the gathered model, on one device's view.
  import functools

  import jax
  import optax

  from examples.lm import configs, stages
  from examples.lm import model as lm_model

  mesh = jax.make_mesh(tuple(shape.values()), tuple(shape))
  preset = configs.PRESETS["tiny"]
  model = lm_model.make_model(preset, preset.seq_len, 1, schedule and "gpipe")
  loss = functools.partial(lm_model.loss_fn, model=model)
  setup = stages.make_setup(stage, mesh, optax.sgd(0.1), loss)
  initial = stages.place_on_model_axis(lm_model.init_params(model, 0), mesh)
  params = setup.place(initial)
  whole = lm_model.make_model(preset, preset.seq_len)
  tokens = np.random.default_rng(0).integers(0, 256, (16, preset.seq_len + 1))
  x, y = tokens[:, :-1], tokens[:, 1:]
  losses = functools.partial(lm_model.example_losses, model=model)
  stored = jax.jit(lambda p, x, y: setup.forward(losses)(p, x, y).mean())(params, x, y)
  gathered = jax.device_get(setup.tx.gather(params))
  reference = lm_model.loss_fn(gathered, x, y, model=whole)
  np.testing.assert_allclose(stored, reference, rtol=1e-6)
  key = jax.random.key(1)
  rows = mesh.shape["data"]
  sampled = lm_model.sample(setup.forward, params, model, key, rows, prompt="import ")
  assert sampled == lm_model.sample(lambda fn: fn, gathered, whole, key, prompt="import ")
