// rpcnb device-map editor: one control per local device and peer; the kernel validates
// every change (rpcnb.wire.devicemap) and sends back the problems and the written forms.

const STYLE = `
.rpcnb-devmap { font: 12px/1.4 var(--jp-ui-font-family, sans-serif); color: var(--jp-ui-font-color1, #222); }
.rpcnb-devmap h4 { margin: 8px 0 4px; font-size: 13px; }
.rpcnb-peer { border: 1px solid #ccc; border-radius: 4px; padding: 6px 8px; margin: 6px 0; }
.rpcnb-peer table td { padding: 2px 8px 2px 0; }
.rpcnb-bad { outline: 2px solid #d33; }
.rpcnb-problems { margin: 6px 0; padding-left: 18px; color: #b22; }
.rpcnb-ok { color: #2a7a2a; margin: 6px 0; }
.rpcnb-forms pre { background: var(--jp-layout-color2, #f4f4f4); padding: 4px 6px; margin: 2px 0 6px; white-space: pre-wrap; }
.rpcnb-note { color: #666; }
`;

function render({ model, el }) {
  const root = h("div", { class: "rpcnb-devmap" });
  const style = h("style");
  style.textContent = STYLE;
  el.append(style, root);

  const setEntry = (peer, local, remote) => {
    const mapping = structuredClone(model.get("mapping"));
    mapping[peer] = mapping[peer] || {};
    if (remote) mapping[peer][local] = remote;
    else delete mapping[peer][local];
    model.set("mapping", mapping);
    model.save_changes();
  };

  const draw = () => {
    const me = model.get("me");
    const locals = model.get("local_devices");
    const mapping = model.get("mapping");
    const problems = model.get("problems");
    const forms = model.get("forms");
    const bad = new Set(problems.map((p) => `${p.peer}|${p.device}`));
    root.replaceChildren(
      h("div", {}, h("b", {}, `Device map of ${me}`),
        h("span", { class: "rpcnb-note" }, ` · peers and devices from the ${model.get("source")}`)),
      h("div", { class: "rpcnb-note" },
        `${me}'s devices: ${locals.length ? locals.join(", ") : "none (CPU only)"}`),
    );
    if (!locals.length) {
      root.append(h("div", { class: "rpcnb-note" },
        "This machine has no CUDA device to map. To plan a map, declare the members' GPUs: " +
        "%rpc_devmap --topology worker0=2,worker1=2"));
    }
    for (const peer of model.get("peers")) {
      const box = h("div", { class: "rpcnb-peer", "data-peer": peer.name },
        h("div", {}, h("b", {}, peer.name), h("span", { class: "rpcnb-note" },
          ` (${peer.host || "?"}) · devices: ${peer.devices.length ? peer.devices.join(", ") : "none (CPU only)"}`)));
      const table = h("table");
      for (const local of locals) {
        const current = (mapping[peer.name] || {})[local] || "";
        const select = h("select", { "data-peer": peer.name, "data-local": local,
          "aria-label": `${local} to ${peer.name}` });
        const choices = ["", ...peer.devices];
        if (current && !choices.includes(current)) choices.push(current);
        for (const d of choices) {
          const opt = h("option", { value: d }, d ? `${peer.name} ${d}` : "not mapped");
          if (d === current) opt.selected = true;
          select.append(opt);
        }
        if (bad.has(`${peer.name}|${local}`) || (current && bad.has(`${peer.name}|${current}`))) {
          select.classList.add("rpcnb-bad");
        }
        select.addEventListener("change", () => setEntry(peer.name, local, select.value));
        table.append(h("tr", {}, h("td", {}, `${me} ${local} →`), h("td", {}, select)));
      }
      box.append(table);
      root.append(box);
    }
    if (problems.length) {
      const list = h("ul", { class: "rpcnb-problems" });
      for (const p of problems) list.append(h("li", { class: "rpcnb-problem" }, p.message));
      root.append(h("h4", {}, "What TensorPipe would refuse"), list);
    } else {
      root.append(h("div", { class: "rpcnb-ok rpcnb-valid" }, "✓ TensorPipe would accept this map."));
    }
    root.append(h("h4", {}, "Written forms"), h("div", { class: "rpcnb-forms" },
      h("div", {}, "torch's dict (rpc_init's device map):"), h("pre", { class: "rpcnb-form-dict" }, forms.dict || ""),
      h("div", {}, "DI-engine string (%rpc_init --device-map):"), h("pre", { class: "rpcnb-form-string" }, forms.string || ""),
      h("div", {}, "Python:"), h("pre", { class: "rpcnb-form-python" }, forms.python || "")));
    const button = h("button", { class: "rpcnb-apply" }, "Apply for the next %rpc_init / --join");
    button.addEventListener("click", () => model.send({ event: "apply" }));
    root.append(button, h("div", { class: "rpcnb-applied" }, model.get("applied")));
  };
  draw();
  const events = ["mapping", "problems", "forms", "applied", "peers", "local_devices"];
  for (const e of events) model.on(`change:${e}`, draw);
  return () => {
    for (const e of events) model.off(`change:${e}`, draw);
  };
}

export default { render };
