"""count_collectives and count_collectives_by_axes on hand-written HLO with known answers, and
on real programs."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding

import zerojax
from zerojax.diagnostics import Collective

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
  return zerojax.diagnostics.count_collectives(hlo)[kind]


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
    zerojax.diagnostics.count_collectives(hlo)
  quiet = loop_with_condition("compare(%i, %n), direction=NE", body="no_collectives")
  assert all(c == Collective() for c in zerojax.diagnostics.count_collectives(quiet).values())


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
  counts = zerojax.diagnostics.count_collectives(hlo)
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
  counts = zerojax.diagnostics.count_collectives(hlo)
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
    zerojax.diagnostics.count_collectives(GATHER_BODY)


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
  assert zerojax.diagnostics.count_collectives(lowered.compile()) == expected
  # The unoptimised module has no known_trip_count: the loop conditions give it.
  assert zerojax.diagnostics.count_collectives(lowered.as_text(dialect="hlo")) == expected


# count_collectives_by_axes


def grid(shape, names=("replica", "data"), order=None):
  """An Auto mesh over the 8 devices, in ``order`` of device ids if given."""
  devices = np.array(jax.devices())[order if order is not None else slice(None)]
  return Mesh(devices.reshape(shape), names, axis_types=(AxisType.Auto,) * len(shape))


def by_axes(hlo, mesh):
  """count_collectives_by_axes without zero entries, checked to add up to count_collectives."""
  result = zerojax.diagnostics.count_collectives_by_axes(hlo, mesh)
  expected = zerojax.diagnostics.count_collectives(hlo)
  summed = {kind: Collective() for kind in expected}
  for kinds in result.values():
    assert list(kinds) == list(expected)  # every kind, as count_collectives gives them
    for kind, collective in kinds.items():
      summed[kind].count += collective.count
      summed[kind].bytes += collective.bytes
  assert summed == expected
  return {axes: {k: c for k, c in kinds.items() if c.count} for axes, kinds in result.items()}


def one_collective(attributes, opcode="all-reduce"):
  return f"""
ENTRY %main (a: f32[8]) -> f32[8] {{
  %a = f32[8]{{0}} parameter(0)
  ROOT %c = f32[8]{{0}} {opcode}(%a){attributes}
}}
"""


MESH_2X4 = "mesh['axis_0'=2,'axis_1'=4]"


@pytest.mark.parametrize(
  "shape, attributes, axes",
  [
    # Explicit lists. On (2, 4) devices 0-3 are replica 0; on (4, 2) they are replicas 0 and 1.
    ((2, 4), ", replica_groups={{0,1,2,3},{4,5,6,7}}", ("data",)),
    ((4, 2), ", replica_groups={{0,1,2,3},{4,5,6,7}}", ("replica", "data")),
    ((2, 4), ", replica_groups={{0,4},{1,5},{2,6},{3,7}}", ("replica",)),
    ((2, 4), ", replica_groups={{0,5},{1,4},{2,7},{3,6}}", ("replica", "data")),
    ((2, 4), ", replica_groups={{0},{1},{2},{3},{4},{5},{6},{7}}", ()),
    ((2, 4), ", replica_groups={}", ("replica", "data")),
    ((2, 4), "", ("replica", "data")),  # no replica_groups: all devices
    # Iota lists: [groups, size]<=[dims]T(perm).
    ((2, 4), ", replica_groups=[2,4]<=[8]", ("data",)),
    ((2, 4), ", replica_groups=[4,2]<=[2,4]T(1,0)", ("replica",)),
    ((4, 2), ", replica_groups=[2,4]<=[4,2]T(1,0)", ("replica",)),
    ((2, 4), ", replica_groups=[4,2]<=[2,2,2]T(0,2,1)", ("data",)),
    ((2, 4), ", replica_groups=[1,8]<=[8]", ("replica", "data")),
    # Mesh axes: anonymous axes laid over the device ids, grouped over the named ones.
    ((2, 4), f", replica_groups={MESH_2X4} {{'axis_1'}}", ("data",)),
    ((2, 4), f", replica_groups={MESH_2X4} {{'axis_0'}}", ("replica",)),
    ((2, 4), f", replica_groups={MESH_2X4} {{'axis_0','axis_1'}}", ("replica", "data")),
    ((2, 4), f", replica_groups={MESH_2X4} {{}}", ()),
    ((4, 2), ", replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}", ("replica",)),
    # device_ids as an iota: [2,4]T(1,0) lays 0,4,1,5,2,6,3,7 over the mesh.
    (
      (2, 4),
      ", replica_groups=mesh['axis_0'=8,'axis_1'=1], device_ids=([2,4]T(1,0)) {'axis_0'}",
      ("replica", "data"),
    ),
    (
      (2, 4),
      ", replica_groups=mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], "
      "device_ids=([2,4]T(1,0)) {'axis_1'}",
      ("data",),
    ),
    (
      (2, 4),
      ", replica_groups=mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], "
      "device_ids=([2,4]T(1,0)) {'axis_2'}",
      ("replica",),
    ),
    # device_ids as a list: rows [0,4,1,5] and [2,6,3,7].
    (
      (2, 4),
      f", replica_groups={MESH_2X4}, device_ids=(0,4,1,5,2,6,3,7) {{'axis_1'}}",
      ("replica", "data"),
    ),
    ((2, 4), f", replica_groups={MESH_2X4}, device_ids=(0,4,1,5,2,6,3,7) {{'axis_0'}}", ("data",)),
    # Sub-axes 'a':(pre)size: the factor of size `size` after major factors of product `pre`.
    ((2, 2, 2), ", replica_groups=mesh['a'=4,'b'=2] {'a':(1)2}", ("replica",)),
    ((2, 2, 2), ", replica_groups=mesh['a'=4,'b'=2] {'a':(2)2}", ("data",)),
    ((2, 2, 2), ", replica_groups=mesh['a'=4,'b'=2] {'a':(2)2,'b'}", ("data", "model")),
    ((2, 2, 2), ", replica_groups=mesh['a'=8] {'a':(1)2,'a':(4)2}", ("replica", "model")),
    (
      (2, 2, 2),
      ", replica_groups=mesh['a'=4,'b'=2], device_ids=([2,2,2]T(0,2,1)) {'a':(2)2}",
      ("model",),
    ),
    # Collective-permute: the axes in which a source and its target differ.
    ((2, 4), ", source_target_pairs={{0,1},{1,2},{2,3},{3,0}}", ("data",)),
    ((2, 4), ", source_target_pairs={{0,4},{4,0}}", ("replica",)),
    ((2, 4), ", source_target_pairs={{0,0},{2,4},{4,2}}", ("replica", "data")),
    ((2, 4), ", source_target_pairs={{0,0},{1,1}}", ()),
    ((2, 4), ", source_target_pairs={}", ()),
  ],
)
def test_device_group_formats(shape, attributes, axes):
  names = ("replica", "data", "model")[: len(shape)]
  opcode = "collective-permute" if "source_target" in attributes else "all-reduce"
  hlo = one_collective(attributes, opcode)
  assert by_axes(hlo, grid(shape, names)) == {axes: {opcode: Collective(1, 32)}}


@pytest.mark.parametrize(
  "attributes, opcode, message",
  [
    (", replica_groups=maximal_mesh[device_id=0] {}", "all-reduce", "none of the formats"),
    (", replica_groups=[[0,1],[2,3]]", "all-reduce", "none of the formats"),
    (", replica_groups=[2,4]<=[6]", "all-reduce", "does not hold 2x4"),
    (", replica_groups=[2,4]<=[2,4]T(0,0)", "all-reduce", "must permute"),
    (", replica_groups={{0,8}}", "all-reduce", r"names devices \[8\]"),
    (f", replica_groups={MESH_2X4} {{'axis_9'}}", "all-reduce", "axis 'axis_9'"),
    (f", replica_groups={MESH_2X4}, device_ids=(0,1,2) {{'axis_0'}}", "all-reduce", "device_ids 3"),
    (", replica_groups=mesh['a'=4,'b'=2] {'a':(3)2}", "all-reduce", "does not divide"),
    ("", "collective-permute", "has no source_target_pairs"),
  ],
)
def test_unreadable_device_groups_are_errors(attributes, opcode, message):
  with pytest.raises(ValueError, match=message):
    zerojax.diagnostics.count_collectives_by_axes(one_collective(attributes, opcode), grid((2, 4)))


def test_wrong_mesh_is_an_error():
  hlo = "HloModule m, num_partitions=4\n" + one_collective(", replica_groups={}")
  with pytest.raises(ValueError, match="runs on 4 devices but the mesh has 8"):
    zerojax.diagnostics.count_collectives_by_axes(hlo, grid((2, 4)))
  with pytest.raises(ValueError, match=r"must be a jax\.sharding\.Mesh"):
    zerojax.diagnostics.count_collectives_by_axes(hlo, jax.sharding.AbstractMesh((4,), ("data",)))
  # Compiled on devices 0-3, asked about a mesh of devices 4-7.
  devices = np.array(jax.devices())
  first, last = Mesh(devices[:4], ("data",)), Mesh(devices[4:], ("data",))
  f = jax.shard_map(
    lambda x: jax.lax.psum(x, "data"), mesh=first, in_specs=jax.P("data"), out_specs=jax.P()
  )
  compiled = jax.jit(f).lower(jnp.ones(8)).compile()
  with pytest.raises(ValueError, match=r"devices \[0, 1, 2, 3\] that are not in the mesh"):
    zerojax.diagnostics.count_collectives_by_axes(compiled, last)


def test_loops_async_and_combined_collectives_keep_their_accounting():
  # count_collectives' own cases, split by axes: a loop of 3 over a data group and an
  # asynchronous all-reduce plus a combined all-gather across replicas.
  across, iota = "{{0,4},{1,5},{2,6},{3,7}}", "[4,2]<=[2,4]T(1,0)"
  hlo = (
    ADD
    + f"""
%body (p: f32[8]) -> f32[8] {{
  %p = f32[8]{{0}} parameter(0)
  %ag = f32[64]{{0}} all-gather(%p), replica_groups=[2,4]<=[8], dimensions={{0}}
  ROOT %s = f32[8]{{0}} slice(%ag), slice={{[0:8]}}
}}

ENTRY %main (a: f32[8], b: f32[16]) -> f32[8] {{
  %a = f32[8]{{0}} parameter(0)
  %b = f32[16]{{0}} parameter(1)
  %w = f32[8]{{0}} while(%a), condition=%cond, body=%body, {trip_count(3)}
  %ar-start = f32[8]{{0}} all-reduce-start(%w), replica_groups={across}, to_apply=%add
  %ar-done = f32[8]{{0}} all-reduce-done(%ar-start)
  %ag2 = (f32[16]{{0}}, f32[32]{{0}}) all-gather(%a, %b), replica_groups={iota}, dimensions={{0}}
  ROOT %r = f32[8]{{0}} add(%ar-done, %w)
}}
"""
  )
  assert by_axes(hlo, grid((2, 4))) == {
    ("replica",): {"all-reduce": Collective(1, 32), "all-gather": Collective(1, 4 * (16 + 32))},
    ("data",): {"all-gather": Collective(3, 3 * 256)},
  }


def every_kind(axis, size):
  """A shard_map body that runs each kind of collective once over ``axis`` (of ``size``)."""

  def layer(carry, x):  # x: this device's 8 floats of a row
    gathered = jax.lax.all_gather(x, axis, tiled=True)
    scattered = jax.lax.psum_scatter(gathered, axis, tiled=True)
    permuted = jax.lax.ppermute(x, axis, [(i, (i + 1) % size) for i in range(size)])
    exchanged = jax.lax.all_to_all(gathered.reshape(size, 8), axis, 0, 0, tiled=True)
    total = jax.lax.psum(scattered + permuted, axis).sum() + exchanged.sum()
    return carry + total, None

  return layer


@pytest.mark.parametrize("shape", [(2, 4), (4, 2)])
@pytest.mark.parametrize("order", [None, [3, 1, 6, 0, 7, 2, 5, 4]], ids=["iota", "permuted"])
def test_compiled_shard_map_programs(shape, order):
  mesh = grid(shape, order=order)
  replicas, data = shape

  def f(xs):  # xs: [2, 3, 8] per device; nested scans of 2 and 3 steps
    def inner(carry, xs):
      carry = jax.lax.scan(every_kind("data", data), carry, xs)[0]
      carry = jax.lax.scan(every_kind("replica", replicas), carry, xs)[0]
      return carry, None

    total = jax.lax.scan(inner, jnp.zeros(()), xs)[0]
    return jax.lax.psum(total, ("replica", "data"))

  g = jax.shard_map(
    f,
    mesh=mesh,
    in_specs=jax.P(None, None, ("replica", "data")),
    out_specs=jax.P(),
    check_vma=False,
  )
  compiled = jax.jit(g).lower(jnp.ones((2, 3, 8 * 8))).compile()
  steps, row = 2 * 3, 4 * 8

  def expected(size):
    full = row * size
    return {
      "all-gather": Collective(steps, steps * full),
      "reduce-scatter": Collective(steps, steps * full),
      "all-reduce": Collective(steps, steps * row),
      "all-to-all": Collective(steps, steps * full),
      "collective-permute": Collective(steps, steps * row),
    }

  want = {
    ("replica",): expected(replicas),
    ("replica", "data"): {"all-reduce": Collective(1, 4)},
    ("data",): expected(data),
  }
  assert by_axes(compiled, mesh) == want
  # Text: the numbers are positions in mesh.devices.flat, the order jit gave the program.
  assert by_axes(compiled.as_text(), mesh) == want


def test_a_compiled_program_asked_about_a_differently_ordered_mesh():
  # The program's device list is read from the executable, so any mesh of its devices works:
  # here the transpose of the one it was compiled over, with axes named in the other order.
  mesh = grid((2, 4))
  g = jax.shard_map(
    lambda x: jax.lax.psum(x, "data"),
    mesh=mesh,
    in_specs=jax.P("replica", "data"),
    out_specs=jax.P("replica"),
  )
  compiled = jax.jit(g).lower(jnp.ones((2, 8))).compile()
  transposed = Mesh(mesh.devices.T, ("data", "replica"))
  assert by_axes(compiled, transposed) == {("data",): {"all-reduce": Collective(1, 8)}}


@pytest.mark.parametrize("shape", [(2, 4), (4, 2)])
def test_compiled_gspmd_programs(shape):
  # GSPMD prints groups as mesh axes, with device_ids when the anonymous mesh is transposed.
  mesh = grid(shape)
  x = jnp.ones((16, 16))

  def compiled(f, in_spec, out_spec):
    shardings = NamedSharding(mesh, in_spec), NamedSharding(mesh, out_spec)
    return jax.jit(f, in_shardings=shardings[0], out_shardings=shardings[1]).lower(x).compile()

  blocks = jax.P("replica", "data")
  sum_rows = compiled(lambda x: x.sum(0), blocks, jax.P("data"))
  assert by_axes(sum_rows, mesh) == {("replica",): {"all-reduce": Collective(1, 64 // shape[1])}}
  sum_columns = compiled(lambda x: x.sum(1), blocks, jax.P("replica"))
  assert by_axes(sum_columns, mesh) == {("data",): {"all-reduce": Collective(1, 64 // shape[0])}}
  gather = compiled(lambda x: x * 2, blocks, jax.P(None, "data"))
  assert by_axes(gather, mesh) == {("replica",): {"all-gather": Collective(1, 64 * 16 // shape[1])}}
  # Rows split over (data, replica): the sum over rows needs every device.
  flat = compiled(lambda x: x.sum(0), jax.P(("data", "replica")), jax.P())
  assert list(by_axes(flat, mesh)) == [("replica", "data")]


@pytest.mark.parametrize("shape", [(2, 4), (4, 2)])
def test_stage3_under_hybrid_sharding_keeps_parameter_traffic_inside_data_groups(shape):
  # Gathers and reduce-scatters stay inside a data group; only the finished gradient shard
  # (and scalars) cross replicas.
  mesh = jax.make_mesh(shape, ("replica", "data"), axis_types=(AxisType.Auto,) * 2)
  data = shape[1]
  tx = zerojax.zero3(optax.adam(1e-3), mesh=mesh, replica_axis="replica")
  params = tx.shard({"w": jnp.ones((64, 64))})
  state = tx.init(params)

  def loss_fn(params, x):
    return jnp.mean((x @ zerojax.gather(params["w"])) ** 2)

  @jax.jit
  def step(params, state, x):
    loss, grads = zerojax.value_and_grad(loss_fn, tx)(params, x)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  counts = by_axes(step.lower(params, state, jnp.ones((16, 64))).compile(), mesh)
  w_bytes = 64 * 64 * 4
  assert counts[("data",)]["all-gather"] == Collective(1, w_bytes)
  assert counts[("data",)]["reduce-scatter"] == Collective(1, w_bytes)
  crossing = {axes: kinds for axes, kinds in counts.items() if "replica" in axes}
  assert crossing == {
    ("replica",): {"all-reduce": Collective(1, w_bytes // data)},  # the gradient shard
    ("replica", "data"): {"all-reduce": Collective(1, 4)},  # the loss
  }


def test_compiled_transpose_with_a_sub_axis():
  # x.T with rows split over (a, b) and columns over c: device (a, b, c) needs the blocks of
  # devices (c, 0, a) and (c, 1, a). XLA swaps a and c with a collective-permute, then runs an
  # all-to-all over b, printed as a sub-axis: replica_groups=mesh[...] {'axis_1':(2)2}.
  mesh = grid((2, 2, 2), ("a", "b", "c"))
  sharding = NamedSharding(mesh, jax.P(("a", "b"), "c"))
  transpose = jax.jit(lambda x: x.T, in_shardings=sharding, out_shardings=sharding)
  compiled = transpose.lower(jnp.ones((16, 16))).compile()
  assert ":(2)2}" in compiled.as_text()
  assert by_axes(compiled, mesh) == {
    ("a", "c"): {"collective-permute": Collective(1, 4 * 4 * 8)},
    ("b",): {"all-to-all": Collective(1, 4 * 4 * 8)},
  }
