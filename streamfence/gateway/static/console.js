// streamfence console: follows the page's live stream (SSE from the gateway).
// Fragments the server sends are escaped there; call text is set as text only.
"use strict";
(function () {
  var live = document.body.getAttribute("data-live");
  if (!live) return;
  var note = document.getElementById("live");
  var source = new EventSource(live);
  function on(name, handle) { source.addEventListener(name, handle); }
  function say(text) { if (note) note.textContent = text; }
  source.onopen = function () { say("live"); document.body.classList.add("is-live"); };
  source.onerror = function () { say("reconnecting…"); document.body.classList.remove("is-live"); };
  on("trouble", function (e) { say("the daemon: " + e.data); });
  on("end", function () { source.close(); say("ended"); document.body.classList.remove("is-live"); });

  // The calls list: the rows, replaced; the ages tick here between updates.
  on("rows", function (e) {
    var rows = document.getElementById("rows");
    if (rows) rows.innerHTML = e.data;
  });
  function age(s) {
    s = Math.max(0, s);
    if (s < 60) return Math.round(s) + "s";
    if (s < 3600) return Math.floor(s / 60) + "m";
    if (s < 86400) return Math.floor(s / 3600) + "h";
    return Math.floor(s / 86400) + "d";
  }
  setInterval(function () {
    var now = Date.now() / 1000;
    document.querySelectorAll("td[data-created]").forEach(function (td) {
      td.textContent = age(now - parseFloat(td.getAttribute("data-created")));
    });
  }, 1000);

  // One call: its state and attempts, replaced; its transcript, as text.
  on("call", function (e) {
    var call = JSON.parse(e.data);
    var attempts = document.getElementById("attempts");
    var state = document.getElementById("call-state");
    if (attempts) attempts.innerHTML = call.attempts;
    if (state) state.innerHTML = call.badge;
    var cancel = document.getElementById("cancel");
    if (cancel && !call.live) cancel.remove();
  });
  var transcript = document.getElementById("transcript");
  var current = null;
  var lastSeq = 0;  // a reconnected stream replays from seq 1: what was shown is skipped
  function block(attempt) {
    current = document.createElement("div");
    current.className = "part";
    current.setAttribute("data-attempt", attempt);
    var label = document.createElement("span");
    label.className = "label";
    label.textContent = "attempt " + attempt;
    current.appendChild(label);
    transcript.appendChild(current);
  }
  on("delta", function (e) {
    var d = JSON.parse(e.data);
    if (d.seq <= lastSeq) return;
    lastSeq = d.seq;
    if (!current || current.getAttribute("data-attempt") !== String(d.attempt)) block(d.attempt);
    var span = document.createElement("span");
    span.className = "k-" + d.kind;
    span.textContent = typeof d.data === "string" ? d.data : JSON.stringify(d.data);
    current.appendChild(span);
  });
  on("reset", function (e) {
    var r = JSON.parse(e.data);
    if (r.seq <= lastSeq) return;
    lastSeq = r.seq;
    transcript.querySelectorAll(".part").forEach(function (p) { p.classList.add("voided"); });
    var mark = document.createElement("div");
    mark.className = "reset";
    mark.textContent = "reset (seq " + r.seq + "): attempt " + r.attempt +
      " starts the answer again; the text above is void";
    transcript.appendChild(mark);
    current = null;
  });
  on("done", function (e) {
    var d = JSON.parse(e.data);
    var ended = document.getElementById("ended");
    if (ended) {
      ended.textContent = "done (seq " + d.seq + "): " + d.status + ", " + d.attempts +
        " attempt(s)" + (d.error ? " · " + d.error.code + ": " + d.error.message : "");
      ended.className = "ended s-" + d.status;
    }
  });

  // The daemon: its sections, replaced.
  on("daemon", function (e) {
    var daemon = document.getElementById("daemon");
    if (daemon) daemon.innerHTML = e.data;
  });
})();
