/* kernelmill dashboard: small progressive enhancements; every page works without this file. */
(function () {
  "use strict";

  var FINISHED = { done: true, failed: true, cancelled: true };

  // Job page: poll the job's JSON; when it moved, fetch the live part of the page and swap it in.
  function startLive(root) {
    var api = root.getAttribute("data-api");
    var partial = root.getAttribute("data-partial");
    var version = root.getAttribute("data-version") || "";
    var delay = 2000;
    if (FINISHED[version.split(":")[0]]) return;

    function schedule() { window.setTimeout(tick, delay); }

    // Someone is using a form of the live part (typing the API token into the cancel form): swapping the part
    // in would wipe what they typed, so the swap waits until they are done.
    function inUse() {
      var focused = document.activeElement;
      if (focused && focused.form && root.contains(focused)) return true;
      return Array.prototype.some.call(root.querySelectorAll("input:not([type=hidden])"), function (el) {
        return el.value !== "";
      });
    }

    function tick() {
      fetch(api, { headers: { Accept: "application/json" }, cache: "no-store" })
        .then(function (r) { return r.ok ? r.json() : null; })
        .then(function (job) {
          if (!job) { delay = Math.min(delay * 2, 30000); return schedule(); }
          var now = job.state + ":" + job.trials_done;
          if (now === version || inUse()) return schedule();
          var started = Date.now();
          return fetch(partial, { headers: { Accept: "text/html" }, cache: "no-store" })
            .then(function (r) { return r.ok ? r.text() : null; })
            .then(function (html) {
              if (html !== null) {
                root.innerHTML = html;
                version = now;
                root.setAttribute("data-version", now);
              }
              // a big job's page is slow to build: ask for it less often
              delay = Math.min(Math.max(2000, 4 * (Date.now() - started)), 30000);
              if (!FINISHED[job.state]) schedule();
            });
        })
        .catch(function () { delay = Math.min(delay * 2, 30000); schedule(); });
    }
    schedule();
  }

  // New-job form: show the shape hint and attributes of the chosen op only.
  function startForm(select) {
    function update() {
      var op = select.value;
      document.querySelectorAll("[data-op]").forEach(function (el) {
        el.hidden = el.getAttribute("data-op") !== op;
      });
      var hint = document.querySelector('.op-hint[data-op="' + op + '"] code');
      var shapes = document.getElementById("shapes");
      if (hint && shapes) shapes.placeholder = hint.textContent;
    }
    select.addEventListener("change", update);
    update();
  }

  document.addEventListener("DOMContentLoaded", function () {
    var live = document.querySelector("[data-live]");
    if (live) startLive(live);
    var op = document.querySelector("form select#op");
    if (op) startForm(op);
    document.querySelectorAll("form[data-autosubmit] select").forEach(function (sel) {
      sel.addEventListener("change", function () { sel.form.submit(); });
    });
  });
})();
