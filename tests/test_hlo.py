"""count_collectives on hand-written HLO modules with known answers, and on real programs."""

import jax
import jax.numpy as jnp
import pytest

import zerojax
from zerojax import Collective

ADD = """
%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}
"""

# One all-gather of 8 floats into 64 floats: 256 bytes per execution.
GATHER_BODY = """
%gather_body (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  %ag = f32[64]{0} all-gather(%p), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  ROOT %s = f32[8]{0} slice(%ag), slice={[0:8]}
}
"""


def trip_count(n):
  return f'backend_config={{"known_trip_count":{{"n":"{n}"}}}}'


def count(hlo, kind):
  return zerojax.count_collectives(hlo)[kind]


@pytest.mark.parametrize("strip_percent", [False, True], ids=["compiled-style", "no-percent"])
def test_collective_in_a_loop_counts_once_per_iteration(strip_percent):
  hlo = (
    GATHER_BODY
    + f"""
ENTRY %main (a: f32[8]) -> f32[8] {{
  %a = f32[8]{{0}} parameter(0)
  ROOT %w = f32[8]{{0}} while(%a), condition=%cond, body=%gather_body, {trip_count(4)}
}}
"""
  )
  hlo = hlo.replace("%", "") if strip_percent else hlo
  assert count(hlo, "all-gather") == Collective(count=4, bytes=4 * 256)


def test_nested_loops_multiply():
  hlo = (
    ADD
    + GATHER_BODY
    + f"""
%outer_body (q: f32[8]) -> f32[8] {{
  %q = f32[8]{{0}} parameter(0)
  %inner = f32[8]{{0}} while(%q), condition=%cond, body=%gather_body, {trip_count(2)}
  ROOT %ar = f32[8]{{0}} all-reduce(%inner), to_apply=%add
}}

ENTRY %main (a: f32[8]) -> f32[8] {{
  %a = f32[8]{{0}} parameter(0)
  ROOT %outer = f32[8]{{0}} while(%a), condition=%cond, body=%outer_body, {trip_count(3)}
}}
"""
  )
  assert count(hlo, "all-gather") == Collective(count=6, bytes=6 * 256)
  assert count(hlo, "all-reduce") == Collective(count=3, bytes=3 * 32)


def loop_with_condition(compare, body="gather_body"):
  return (
    GATHER_BODY
    + f"""
%cond (c: (s32[], f32[8])) -> pred[] {{
  %c = (s32[], f32[8]{{0}}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant(5)
  ROOT %test = pred[] {compare}
}}

%no_collectives (r: f32[8]) -> f32[8] {{
  ROOT %r = f32[8]{{0}} parameter(0)
}}

ENTRY %main (a: (s32[], f32[8])) -> (s32[], f32[8]) {{
  %a = (s32[], f32[8]{{0}}) parameter(0)
  ROOT %w = (s32[], f32[8]{{0}}) while(%a), condition=%cond, body=%{body}
}}
"""
  )


def test_trip_count_from_the_condition_without_known_trip_count():
  hlo = loop_with_condition("compare(%i, %n), direction=LT")
  assert count(hlo, "all-gather") == Collective(count=5, bytes=5 * 256)


def test_unknown_trip_count_is_an_error_only_if_the_loop_has_collectives():
  hlo = loop_with_condition("compare(%i, %n), direction=NE")
  with pytest.raises(ValueError, match="trip count of while loop w"):
    zerojax.count_collectives(hlo)
  quiet = loop_with_condition("compare(%i, %n), direction=NE", body="no_collectives")
  assert all(c == Collective() for c in zerojax.count_collectives(quiet).values())


def test_async_start_and_done_count_once():
  hlo = (
    ADD
    + """
%wrapped_rs (s: f32[64]) -> f32[8] {
  %s = f32[64]{0} parameter(0)
  ROOT %rs = f32[8]{0} reduce-scatter(%s), dimensions={0}, to_apply=%add
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %ag-start = (f32[8]{0}, f32[64]{0}) all-gather-start(%a), dimensions={0}
  %ag-done = f32[64]{0} all-gather-done(%ag-start)
  %ar-start = f32[8]{0} all-reduce-start(%a), to_apply=%add
  %ar-done = f32[8]{0} all-reduce-done(%ar-start)
  %rs-start = ((f32[64]{0}), f32[8]{0}, s32[]) async-start(%ag-done), calls=%wrapped_rs
  %rs-update = ((f32[64]{0}), f32[8]{0}, s32[]) async-update(%rs-start), calls=%wrapped_rs
  %rs-done = f32[8]{0} async-done(%rs-update), calls=%wrapped_rs
  ROOT %out = f32[8]{0} add(%ar-done, %rs-done)
}
"""
  )
  counts = zerojax.count_collectives(hlo)
  assert counts["all-gather"] == Collective(count=1, bytes=256)
  assert counts["all-reduce"] == Collective(count=1, bytes=32)
  assert counts["reduce-scatter"] == Collective(count=1, bytes=256)


def test_reduce_scatter_counts_its_operand():
  # Groups of 4 (iota replica groups): the operand is 4 times the result.
  hlo = (
    ADD
    + """
ENTRY %main (a: f32[32]) -> f32[8] {
  %a = f32[32]{0} parameter(0)
  ROOT %rs = f32[8]{0} reduce-scatter(%a), replica_groups=[2,4]<=[8], dimensions={0}, to_apply=%add
}
"""
  )
  assert count(hlo, "reduce-scatter") == Collective(count=1, bytes=128)


def test_combined_collectives_sum_their_arrays():
  hlo = (
    ADD
    + """
ENTRY %main (a: f32[8], b: f32[16], c: bf16[4]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %b = f32[16]{0} parameter(1)
  %c = bf16[4]{0} parameter(2)
  %ar = (f32[8], f32[16], /*index=2*/bf16[4]) all-reduce(%a, %b, /*index=2*/%c), to_apply=%add
  %ag = (f32[64]{0}, f32[128]{0}) all-gather(%a, %b), dimensions={0}
  ROOT %r = f32[8]{0} get-tuple-element(%ar), index=0
}
"""
  )
  counts = zerojax.count_collectives(hlo)
  assert counts["all-reduce"] == Collective(count=1, bytes=32 + 64 + 8)
  assert counts["all-gather"] == Collective(count=1, bytes=4 * (64 + 128))


@pytest.mark.parametrize(
  "dtype, width", [("bf16", 2), ("f16", 2), ("f32", 4), ("f64", 8), ("s8", 1), ("pred", 1)]
)
def test_bytes_per_element(dtype, width):
  hlo = f"""
ENTRY %main (a: {dtype}[8]) -> {dtype}[64] {{
  %a = {dtype}[8]{{0}} parameter(0)
  ROOT %ag = {dtype}[64]{{0}} all-gather(%a), dimensions={{0}}
}}
"""
  assert count(hlo, "all-gather") == Collective(count=1, bytes=64 * width)


def test_called_computations_and_every_conditional_branch_count():
  hlo = (
    ADD
    + """
%reduce (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %ar = f32[8]{0} all-reduce(%p), to_apply=%add
}

%reduce_twice (q: f32[8]) -> f32[8] {
  %q = f32[8]{0} parameter(0)
  %once = f32[8]{0} call(%q), to_apply=%reduce
  ROOT %twice = f32[8]{0} call(%once), to_apply=%reduce
}

ENTRY %main (i: s32[], a: f32[8]) -> f32[8] {
  %i = s32[] parameter(0)
  %a = f32[8]{0} parameter(1)
  ROOT %c = f32[8]{0} conditional(%i, %a, %a), branch_computations={%reduce, %reduce_twice}
}
"""
  )
  assert count(hlo, "all-reduce") == Collective(count=3, bytes=3 * 32)


def test_text_without_an_entry_computation_is_an_error():
  with pytest.raises(ValueError, match="no ENTRY computation"):
    zerojax.count_collectives(GATHER_BODY)


def test_a_compiled_shard_map_program(mesh):
  n = mesh.shape["data"]
  ring = [(i, (i + 1) % n) for i in range(n)]

  def layer(carry, x):  # x: this device's 8 floats of a row
    gathered = jax.lax.all_gather(x, "data", tiled=True)
    scattered = jax.lax.psum_scatter(gathered, "data", tiled=True)
    permuted = jax.lax.ppermute(x, "data", ring)
    exchanged = jax.lax.all_to_all(gathered.reshape(n, 8), "data", 0, 0, tiled=True)
    total = jax.lax.psum(scattered + permuted, "data").sum() + exchanged.sum()
    return carry + total, None

  def inner(carry, xs):
    return jax.lax.scan(layer, carry, xs)[0], None

  def f(xs):
    return jax.lax.scan(inner, jnp.zeros(()), xs)[0]

  g = jax.shard_map(
    f, mesh=mesh, in_specs=jax.P(None, None, "data"), out_specs=jax.P(), check_vma=False
  )
  lowered = jax.jit(g).lower(jnp.ones((2, 3, 8 * n)))
  steps, row, full = 2 * 3, 4 * 8, 4 * 8 * n
  expected = {
    "all-gather": Collective(steps, steps * full),
    "reduce-scatter": Collective(steps, steps * full),
    "all-reduce": Collective(steps, steps * row),
    "all-to-all": Collective(steps, steps * full),
    "collective-permute": Collective(steps, steps * row),
  }
  assert zerojax.count_collectives(lowered.compile()) == expected
  # The unoptimised module has no known_trip_count: the loop conditions give it.
  assert zerojax.count_collectives(lowered.as_text(dialect="hlo")) == expected
