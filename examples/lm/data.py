"""The data examples/train_lm.py trains on: Python's standard library, as bytes, no download.

The corpus is the running interpreter's top-level ``*.py`` files, sorted by
name and capped, read as bytes (the vocabulary is the 256 byte values). The
last ``VAL_FRACTION`` is held out. Batches are windows at random starts that
are a function of the seed and the step alone, so a resumed run trains on
exactly the batches an uninterrupted one would; each process builds only its
own rows and ``zerojax.distributed.global_batch`` joins them over the mesh. ``Batches``
puts it together for a run: the training batch of each step and the one
validation batch, split over the mesh.
"""

from __future__ import annotations

import pathlib
import sysconfig
from typing import NamedTuple

import jax
import numpy as np

import zerojax

from . import configs

VOCAB = 256  # bytes
MAX_CORPUS_BYTES = 3 * 2**20
VAL_FRACTION = 0.05


class Corpus(NamedTuple):
  """The training and validation bytes."""

  train: np.ndarray
  val: np.ndarray


def load_corpus() -> Corpus:
  """The standard library's top-level ``*.py`` files, sorted by name, as bytes (capped), split."""
  stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
  chunks, size = [], 0
  for path in sorted(stdlib.glob("*.py")):
    chunks.append(path.read_bytes())
    size += len(chunks[-1])
    if size >= MAX_CORPUS_BYTES:
      break
  corpus = np.frombuffer(b"".join(chunks)[:MAX_CORPUS_BYTES], np.uint8)
  split = int(len(corpus) * (1 - VAL_FRACTION))
  return Corpus(corpus[:split], corpus[split:])


def unigram_loss(train: np.ndarray, val: np.ndarray) -> float:
  """Validation cross-entropy (nats) of byte frequencies counted on ``train`` (add-one)."""
  counts = np.bincount(train, minlength=VOCAB) + 1.0
  log_p = np.log(counts / counts.sum())
  return float(-log_p[val].mean())


def windows(data: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
  """Inputs and next-byte targets of the windows of ``data`` beginning at ``starts``."""
  tokens = data[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)
  return tokens[:, :-1], tokens[:, 1:]


def validation_starts(corpus: Corpus, count: int, seq_len: int) -> np.ndarray:
  """``count`` window starts spread evenly over the validation bytes."""
  return np.linspace(0, len(corpus.val) - seq_len - 1, count).astype(int)


def train_starts(corpus: Corpus, seed: int, step: int, batch_size: int, seq_len: int) -> np.ndarray:
  """The window starts of step ``step``'s batch: a function of the seed and the step alone."""
  rng = np.random.default_rng([seed, 1, step])
  return rng.integers(0, len(corpus.train) - seq_len - 1, batch_size)


def global_batch(
  data: np.ndarray,
  starts: np.ndarray,
  seq_len: int,
  mesh: jax.sharding.Mesh,
  axes: tuple[str, ...],
  *,
  check_processes: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """The windows at ``starts``, split over ``axes`` of ``mesh``; each process loads its rows only.

  ``check_processes`` checks (once, on a first batch) that every process
  passes the same shapes.
  """
  rows = len(starts) // jax.process_count()
  mine = starts[jax.process_index() * rows :][:rows]
  return zerojax.distributed.global_batch(
    windows(data, mine, seq_len), mesh, axis_name=axes, check_processes=check_processes
  )


class Batches:
  """The corpus, split over a run's mesh: each step's training batch and the validation batch.

  Attributes:
    corpus: the training and validation bytes.
    unigram_loss: the validation loss of byte frequencies, for scale.
    validation: the validation batch, ``configs.EVAL_BATCHES`` times the
      batch size of windows spread evenly over the validation bytes.
  """

  def __init__(self, config: configs.Config, mesh: jax.sharding.Mesh):
    self.corpus = load_corpus()
    if config.seq_len >= len(self.corpus.val):
      raise configs.FlagsError(
        f"--seq-len {config.seq_len} is not shorter than the validation text "
        f"({len(self.corpus.val)} bytes); take a shorter one (the {config.model} model's is "
        f"{config.preset.seq_len})"
      )
    self.unigram_loss = unigram_loss(self.corpus.train, self.corpus.val)
    self._config, self._mesh = config, mesh
    count = configs.EVAL_BATCHES * config.batch_size
    starts = validation_starts(self.corpus, count, config.seq_len)
    self.validation = self._split(self.corpus.val, starts, check_processes=True)

  def train(self, step: int) -> tuple[jax.Array, jax.Array]:
    """Step ``step``'s inputs and targets: a function of the seed and the step alone."""
    config = self._config
    starts = train_starts(self.corpus, config.seed, step, config.batch_size, config.seq_len)
    return self._split(self.corpus.train, starts)

  def _split(self, data, starts, *, check_processes=False):
    config = self._config
    return global_batch(
      data, starts, config.seq_len, self._mesh, config.batch_axes, check_processes=check_processes
    )
