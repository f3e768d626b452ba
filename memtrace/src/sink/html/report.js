// memtrace HTML report: draws the sites table from the embedded JSON, a page
// of rows at a time, with sorting, filtering and a detail view per site.
// Text is only ever set through textContent (symbols contain < > &).
"use strict";
(function () {
  var started = performance.now();
  var data = JSON.parse(document.getElementById("memtrace-data").textContent);
  var frames = data.frames, sites = data.sites;
  var PAGE = 100;
  var TREND = { growing: 0, "new": 1, stable: 2, shrinking: 3 };
  var DESC_FIRST = { bytes: 1, count: 1, growth: 1, age: 1 };
  var state = { key: "rank", dir: 1, filter: "", allocator: "", page: 0, selected: -1 };
  var rows = document.getElementById("rows");
  var count = document.getElementById("count");
  var detail = document.getElementById("detail");
  var filterBox = document.getElementById("filter");
  var allocatorBox = document.getElementById("allocator");
  var view = null;

  function human(b) {
    var units = ["B", "KiB", "MiB", "GiB", "TiB"], u = 0, v = b;
    while (v >= 1024 && u < units.length - 1) { v /= 1024; u++; }
    return u === 0 ? b + " B" : v.toFixed(1) + " " + units[u];
  }
  function age(ms) {
    var s = ms / 1000;
    if (s < 120) return s.toFixed(1) + "s";
    if (s < 7200) return (s / 60).toFixed(1) + "m";
    return (s / 3600).toFixed(1) + "h";
  }
  // A site's top frame as shown, or by its full name (`full`: the sort key).
  function topFrame(site, full) {
    if (!site.stack.length) return site.functions.join(", ");
    var f = frames[site.stack[0]];
    return full ? fullName(f) : f[0];
  }
  function where(f) {
    return f[2] ? f[2] + (f[3] ? ":" + f[3] : "") : "";
  }
  function isPy(f) { return f[7] === "python"; }
  // A frame's full name: f[8] when the shown name f[0] is shortened.
  function fullName(f) { return f[8] || f[0]; }
  // A frame's name cell (its full name the tooltip, then `title`); a Python
  // frame's gets a "py" tag, then the name, in Python's colour. `expand`: a
  // click shows the full name in place (and the short one again).
  function nameCell(tr, f, cls, title, expand) {
    var tip = f[8] ? f[8] + (title ? "\n" + title : "") : title;
    var td = cell(tr, "", (cls ? cls + " " : "") + (isPy(f) ? "py" : "native"), tip);
    if (isPy(f)) {
      var tag = document.createElement("span");
      tag.className = "tag py";
      tag.textContent = "py";
      td.appendChild(tag);
      td.appendChild(document.createTextNode(" "));
    }
    var text = document.createTextNode(f[0]);
    td.appendChild(text);
    if (expand && f[8]) {
      td.className += " expand";
      td.addEventListener("click", function () {
        text.textContent = text.textContent === f[0] ? f[8] : f[0];
      });
    }
    return td;
  }
  function haystack(site) {
    if (site._q === undefined) {
      var parts = [site.allocator, site.memory, site.functions.join(" ")];
      for (var i = 0; i < site.stack.length; i++) {
        var f = frames[site.stack[i]];
        parts.push(fullName(f), f[1] || "", where(f));
      }
      site._q = parts.join("\n").toLowerCase();
    }
    return site._q;
  }
  function value(site, key) {
    switch (key) {
      case "trend": return TREND[site.trend];
      case "frame": return topFrame(site, true);
      case "pattern": return site.pattern || "";
      default: return site[key];
    }
  }
  function compute() {
    var needle = state.filter.trim().toLowerCase();
    var list = [];
    for (var i = 0; i < sites.length; i++) {
      var s = sites[i];
      if (state.allocator && s.allocator !== state.allocator) continue;
      if (needle && haystack(s).indexOf(needle) < 0) continue;
      list.push(i);
    }
    var key = state.key, dir = state.dir;
    list.sort(function (a, b) {
      var x = value(sites[a], key), y = value(sites[b], key);
      var c = x < y ? -1 : x > y ? 1 : 0;
      return c * dir || sites[a].rank - sites[b].rank;
    });
    view = list;
  }
  function cell(tr, text, cls, title) {
    var td = document.createElement("td");
    td.textContent = text;
    if (cls) td.className = cls;
    if (title) td.title = title;
    tr.appendChild(td);
    return td;
  }
  function render() {
    if (!view) compute();
    var pages = Math.max(1, Math.ceil(view.length / PAGE));
    state.page = Math.min(Math.max(0, state.page), pages - 1);
    var from = state.page * PAGE, to = Math.min(view.length, from + PAGE);
    var body = document.createDocumentFragment();
    for (var r = from; r < to; r++) {
      var i = view[r], s = sites[i];
      var tr = document.createElement("tr");
      tr.dataset.index = i;
      tr.dataset.bytes = s.bytes;
      tr.dataset.count = s.count;
      if (i === state.selected) tr.className = "sel";
      cell(tr, s.rank, "num");
      cell(tr, s.allocator + (s.memory === "host" ? "" : " (" + s.memory + ")"));
      cell(tr, human(s.bytes), "num bytes", s.bytes + " bytes" + (data.sampled ? " (estimate)" : ""));
      cell(tr, s.count, "num");
      cell(tr, s.trend === "growing" ? human(Math.round(s.growth)) + "/s" : "", "num");
      cell(tr, s.trend + (s.internal ? " (allocator-internal)" : ""), "t-" + s.trend);
      cell(tr, age(s.age), "num");
      cell(tr, s.pattern || "");
      var f = s.stack.length ? frames[s.stack[0]] : null;
      if (f) nameCell(tr, f, "frame", where(f));
      else cell(tr, topFrame(s), "frame", s.note || "");
      body.appendChild(tr);
    }
    rows.textContent = "";
    rows.appendChild(body);
    count.textContent = view.length === 0 ? "no site matches" :
      "sites " + (from + 1) + "\u2013" + to + " of " + view.length +
      (view.length !== sites.length ? " (" + sites.length + " in the report)" : "") +
      " \u00b7 page " + (state.page + 1) + "/" + pages;
    document.getElementById("prev").disabled = state.page === 0;
    document.getElementById("next").disabled = state.page >= pages - 1;
    var ths = document.querySelectorAll("#sites-table th[data-key]");
    for (var k = 0; k < ths.length; k++) {
      ths[k].className = ths[k].dataset.key === state.key ? (state.dir > 0 ? "asc" : "desc") : "";
    }
  }
  function spark(points) {
    var ns = "http://www.w3.org/2000/svg", w = 480, h = 90;
    var svg = document.createElementNS(ns, "svg");
    svg.setAttribute("viewBox", "0 0 " + w + " " + h);
    svg.setAttribute("width", w);
    svg.setAttribute("height", h);
    svg.setAttribute("class", "chart");
    var t0 = points[0][0], t1 = points[points.length - 1][0], max = 1;
    for (var i = 0; i < points.length; i++) max = Math.max(max, points[i][1]);
    var coords = points.map(function (p) {
      var x = 6 + (t1 > t0 ? (p[0] - t0) / (t1 - t0) : 0) * (w - 12);
      var y = h - 16 - (p[1] / max) * (h - 30);
      return x.toFixed(1) + "," + y.toFixed(1);
    });
    var line = document.createElementNS(ns, "polyline");
    line.setAttribute("points", coords.join(" "));
    line.setAttribute("fill", "none");
    line.setAttribute("stroke", "#1f77b4");
    line.setAttribute("stroke-width", "1.5");
    svg.appendChild(line);
    var label = document.createElementNS(ns, "text");
    label.setAttribute("x", 6);
    label.setAttribute("y", 12);
    label.setAttribute("class", "cn");
    label.textContent = "live bytes: max " + human(max) + " over " + age(t1 - t0);
    svg.appendChild(label);
    return svg;
  }
  function show(i) {
    state.selected = i;
    var s = sites[i];
    detail.hidden = false;
    detail.textContent = "";
    var h = document.createElement("h3");
    h.textContent = "#" + s.rank + " " + topFrame(s) + " \u2014 " + human(s.bytes) + " in " + s.count +
      " blocks (" + s.allocator + ", " + s.memory + ")" + (data.sampled ? ", estimated" : "");
    detail.appendChild(h);
    var facts = document.createElement("p");
    facts.className = "note";
    facts.textContent = "functions " + s.functions.join(", ") + " \u00b7 trend " + s.trend +
      (s.trend === "growing" ? " (" + human(Math.round(s.growth)) + "/s)" : "") +
      " \u00b7 oldest " + age(s.age) + " \u00b7 survived " + s.survived + " intervals" +
      (s.pattern ? " \u00b7 " + s.pattern : "") +
      " \u00b7 threads " + s.threads.join(", ") + (s.thread_names.length ? " (" + s.thread_names.join(", ") + ")" : "") +
      " \u00b7 pids " + s.pids.join(", ");
    detail.appendChild(facts);
    if (s.history && s.history.length > 1) detail.appendChild(spark(s.history));
    if (s.note) {
      var n = document.createElement("p");
      n.className = "note";
      n.textContent = s.note;
      detail.appendChild(n);
    }
    if (s.stack.length) {
      var table = document.createElement("table");
      table.className = "grid stack";
      var head = document.createElement("tr");
      ["#", "function", "file:line", "module", "offset", "address"].forEach(function (t) {
        var th = document.createElement("th");
        th.textContent = t;
        head.appendChild(th);
      });
      table.appendChild(head);
      s.stack.forEach(function (fi, depth) {
        var f = frames[fi], tr = document.createElement("tr");
        if (isPy(f)) tr.className = "py";
        cell(tr, depth, "num");
        nameCell(tr, f, "", "", true);
        cell(tr, where(f));
        cell(tr, f[1] || "", "", f[6] || "");
        cell(tr, f[5] || "");
        cell(tr, f[4]);
        table.appendChild(tr);
      });
      detail.appendChild(table);
    }
    render();
  }
  function update() { view = null; state.page = 0; render(); }
  document.querySelector("#sites-table thead").addEventListener("click", function (ev) {
    var th = ev.target.closest("th[data-key]");
    if (!th) return;
    var key = th.dataset.key;
    if (state.key === key) state.dir = -state.dir;
    else { state.key = key; state.dir = DESC_FIRST[key] ? -1 : 1; }
    update();
  });
  rows.addEventListener("click", function (ev) {
    var tr = ev.target.closest("tr");
    if (tr && tr.dataset.index !== undefined) show(Number(tr.dataset.index));
  });
  filterBox.addEventListener("input", function () { state.filter = filterBox.value; update(); });
  allocatorBox.addEventListener("change", function () { state.allocator = allocatorBox.value; update(); });
  document.getElementById("prev").addEventListener("click", function () { state.page--; render(); });
  document.getElementById("next").addEventListener("click", function () { state.page++; render(); });
  // Deep links: #filter=TEXT&sort=KEY&dir=asc|desc&site=RANK
  var params = new URLSearchParams(location.hash.slice(1));
  if (params.get("filter")) { state.filter = filterBox.value = params.get("filter"); }
  if (params.get("sort") && document.querySelector("th[data-key='" + params.get("sort").replace(/[^a-z]/g, "") + "']")) {
    state.key = params.get("sort");
    state.dir = DESC_FIRST[state.key] ? -1 : 1;
  }
  if (params.get("dir")) state.dir = params.get("dir") === "desc" ? -1 : 1;
  render();
  var rank = Number(params.get("site"));
  if (rank >= 1 && rank <= sites.length) show(rank - 1);
  // How long parsing the data and drawing the first page took, for the record.
  document.body.dataset.renderMs = Math.round(performance.now() - started);
  document.body.dataset.ready = "1";
})();
