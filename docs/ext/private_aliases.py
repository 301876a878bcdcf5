"""Sphinx extension: types written with zerojax's private module aliases link to the public name.

The code annotates with the private modules it imports (``layout_lib.Layout``,
``precision_lib.Precision``, ``zerojax._src.core.transformation.ZeroState``); the reader knows the
public name (``zerojax.Layout``, ``zerojax.diagnostics.StepProfile``). A reference that
does not resolve, whose prefix is such an alias and whose last part is a documented
``zerojax`` name, or else the last part of exactly one documented name of a public
module of ``zerojax``, is resolved to that name. Anything else stays unresolved, so a
real broken reference still fails.
"""

from docutils import nodes
from sphinx import addnodes
from sphinx.application import Sphinx
from sphinx.environment import BuildEnvironment


def resolve(
  app: Sphinx, env: BuildEnvironment, node: addnodes.pending_xref, contnode: nodes.Element
) -> nodes.reference | None:
  if node.get("refdomain") != "py":
    return None
  prefix, _, name = node["reftarget"].rpartition(".")
  if not (prefix.endswith("_lib") or prefix.startswith("zerojax._src")):
    return None
  domain = env.get_domain("py")
  public = (
    [f"zerojax.{name}"]
    if f"zerojax.{name}" in domain.objects
    else [
      documented
      for documented in domain.objects
      if documented.startswith("zerojax.") and documented.rpartition(".")[2] == name
    ]
  )
  if len(public) != 1:  # none, or a name of two namespaces: leave it unresolved
    return None
  shown = nodes.Text(name) if isinstance(contnode, nodes.Text) else contnode.deepcopy()
  for text in [] if isinstance(shown, nodes.Text) else list(shown.findall(nodes.Text)):
    text.parent.replace(text, nodes.Text(name))  # the public name, not the private path
  return domain.resolve_xref(
    env, node["refdoc"], app.builder, node["reftype"], public[0], node, shown
  )


def setup(app: Sphinx) -> dict:
  app.connect("missing-reference", resolve)
  return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
