"""``narrowed_bits``: float32 rounded to bfloat16 on its bits, bit for bit as ``astype`` rounds."""

import jax
import jax.numpy as jnp
import numpy as np

from zerojax._src.comm import primitives


def astype_bits(x):
  return primitives.as_bits(x.astype(jnp.bfloat16))


def test_every_exponent_and_every_rounding_case_matches_astype():
  # Each exponent (subnormals, zero and inf / NaN too), both signs, with the dropped 16 bits
  # below, at and above one half, the kept part odd and even: ties must round to even.
  rng = np.random.default_rng(0)
  high = np.arange(2**16, dtype=np.uint32) << 16  # every kept half: sign, exponent, mantissa
  low = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], np.uint32)
  bits = (high[:, None] | low[None, :]).ravel()
  bits = np.concatenate([bits, rng.integers(0, 2**32, 2**18, dtype=np.uint32)])
  x = jax.lax.bitcast_convert_type(jnp.asarray(bits), jnp.float32)
  got = np.asarray(primitives.narrowed_bits(x, jnp.bfloat16))
  want = np.asarray(astype_bits(x))
  nan = np.isnan(np.asarray(x))
  np.testing.assert_array_equal(got[~nan], want[~nan])
  # A NaN stays a NaN of its sign (its payload is not part of astype's contract).
  narrowed = jax.lax.bitcast_convert_type(jnp.asarray(got[nan]), jnp.bfloat16)
  assert np.all(np.isnan(np.asarray(narrowed, np.float32)))
  np.testing.assert_array_equal(got[nan] >> 15, (bits[nan] >> 31).astype(np.uint16))


def test_other_dtypes_are_cast():
  x = jnp.linspace(-3.0, 3.0, 101, dtype=jnp.float32)
  np.testing.assert_array_equal(
    primitives.narrowed_bits(x, jnp.float16), primitives.as_bits(x.astype(jnp.float16))
  )
  y = x.astype(jnp.bfloat16)
  np.testing.assert_array_equal(primitives.narrowed_bits(y, jnp.bfloat16), primitives.as_bits(y))
