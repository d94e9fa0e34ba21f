// rpcnb doctor report: the findings of %rpc_doctor, one box per member, problems first,
// each with what to do. "Check again" asks the kernel to run the checks anew.

const LEVELS = { warn: [0, "problem"], note: [1, "note"], ok: [2, "ok"] };

function plural(n, word) {
  return `${n} ${word}${n === 1 ? "" : "s"}`;
}

function byMember(findings) {
  // members in the order the doctor reports them (the leader first), "all" and the
  // user's kept groups ("kept") last
  const groups = new Map();
  for (const f of findings) {
    if (!groups.has(f.member)) groups.set(f.member, []);
    groups.get(f.member).push(f);
  }
  const last = ["all", "kept"];
  const names = [...groups.keys()].filter((n) => !last.includes(n));
  for (const n of last) if (groups.has(n)) names.push(n);
  return names.map((n) => [n, groups.get(n)]);
}

function counts(findings) {
  const warns = findings.filter((f) => f.level === "warn").length;
  const notes = findings.filter((f) => f.level === "note").length;
  const parts = [];
  if (warns) parts.push(plural(warns, "problem"));
  if (notes) parts.push(plural(notes, "note"));
  return parts.length ? parts.join(", ") : "all ok";
}

function memberBox(name, findings, me) {
  const rank = (f) => (LEVELS[f.level] || [3])[0];
  const sorted = [...findings].sort((a, b) => rank(a) - rank(b));
  const worst = sorted.length ? sorted[0].level : "ok";
  const title = name === "all" ? "every member" : name === "kept" ? "kept groups of this user"
    : name === me ? `${name} (this kernel)` : name;
  const table = h("table", { class: "rpcnb-findings" });
  for (const f of sorted) {
    const [, label] = LEVELS[f.level] || [3, f.level];
    const row = h("tr", { class: `rpcnb-finding rpcnb-${f.level}`, "data-check": f.check,
                          "data-level": f.level },
      h("td", {}, h("span", { class: `rpcnb-badge rpcnb-badge-${f.level}` }, label)),
      h("td", { class: "rpcnb-check" }, f.check),
      h("td", {}, h("div", { class: "rpcnb-detail" }, f.detail),
        f.todo ? h("div", { class: "rpcnb-todo" }, h("b", {}, "what to do: "), f.todo) : ""));
    table.append(row);
  }
  return h("div", { class: `rpcnb-member rpcnb-worst-${worst}`, "data-member": name },
    h("div", { class: "rpcnb-member-head" }, h("b", {}, title),
      h("span", { class: "rpcnb-note" }, ` · ${counts(findings)}`)),
    table);
}

const STYLE = `
.rpcnb-doctor { font: 12px/1.4 var(--jp-ui-font-family, sans-serif); color: var(--jp-ui-font-color1, #222); }
.rpcnb-doctor-head { display: flex; gap: 12px; align-items: center; margin: 4px 0 6px; }
.rpcnb-summary { font-weight: 600; font-size: 13px; }
.rpcnb-summary.bad { color: #b22; }
.rpcnb-summary.good { color: #2a7a2a; }
.rpcnb-member { border: 1px solid #ccc; border-left-width: 4px; border-radius: 4px; padding: 4px 8px; margin: 6px 0; }
.rpcnb-worst-warn { border-left-color: #d33; }
.rpcnb-worst-note { border-left-color: #d90; }
.rpcnb-worst-ok { border-left-color: #3a3; }
.rpcnb-member-head { margin-bottom: 2px; }
.rpcnb-findings { border-collapse: collapse; }
.rpcnb-findings td { padding: 3px 10px 3px 0; vertical-align: top; text-align: left; }
.rpcnb-check { font-family: var(--jp-code-font-family, monospace); white-space: nowrap; }
.rpcnb-badge { display: inline-block; min-width: 52px; text-align: center; border-radius: 3px; padding: 0 4px; color: #fff; font-size: 11px; }
.rpcnb-badge-warn { background: #c33; }
.rpcnb-badge-note { background: #c80; }
.rpcnb-badge-ok { background: #393; }
.rpcnb-finding.rpcnb-ok .rpcnb-detail { color: #555; }
.rpcnb-todo { margin-top: 2px; }
.rpcnb-note { color: #666; }
.rpcnb-failed { color: #b22; margin: 4px 0; }
`;

function render({ model, el }) {
  const root = h("div", { class: "rpcnb-doctor" });
  const style = h("style");
  style.textContent = STYLE;
  el.append(style, root);
  let waiting = false;

  const draw = () => {
    const findings = model.get("findings");
    const warns = findings.filter((f) => f.level === "warn").length;
    const when = model.get("checked") ? new Date(model.get("checked") * 1000).toLocaleTimeString() : "";
    const again = h("button", { class: "rpcnb-check-again" }, waiting ? "checking…" : "Check again");
    if (waiting) again.setAttribute("disabled", "");
    again.addEventListener("click", () => {
      waiting = true;
      draw();
      model.send({ event: "check" });
    });
    root.replaceChildren(
      h("div", { class: "rpcnb-doctor-head" },
        h("span", { class: `rpcnb-summary ${warns ? "bad" : "good"}` },
          warns ? `${plural(warns, "problem")} found` : "nothing to fix"),
        h("span", { class: "rpcnb-note" }, `rpcnb doctor for ${model.get("me")}'s group` +
          (when ? ` · checked ${when}` : "")),
        again),
    );
    if (model.get("status")) root.append(h("div", { class: "rpcnb-failed" }, model.get("status")));
    for (const [name, group] of byMember(findings)) root.append(memberBox(name, group, model.get("me")));
  };
  const redraw = () => {
    waiting = false;
    draw();
  };
  draw();
  const events = ["findings", "checked", "status"];
  for (const e of events) model.on(`change:${e}`, redraw);
  return () => {
    for (const e of events) model.off(`change:${e}`, redraw);
  };
}

export default { render };
