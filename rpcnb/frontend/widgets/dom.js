// Shared by rpcnb's widgets (prepended to each widget's module by rpcnb.frontend.widgets.esm):
// h("div", {class: "x"}, child, "text") builds a DOM node.
function h(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c);
  return node;
}
