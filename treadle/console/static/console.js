// treadle console: live fragments over server-sent events, and forms that submit when a control changes.
// No framework: a page works without this file, it only saves reloads.
"use strict";

function follow(section) {
  const status = document.getElementById("live-status");
  const source = new EventSource(section.dataset.live);
  source.addEventListener("changed", async () => {
    const response = await fetch(section.dataset.fragment, { credentials: "same-origin" });
    if (!response.ok) return;
    section.innerHTML = await response.text();
    section.dataset.updates = String(Number(section.dataset.updates || "0") + 1);
    if (status) status.textContent = "live · updated " + new Date().toLocaleTimeString();
  });
  source.addEventListener("open", () => {
    if (status) { status.hidden = false; status.classList.add("on"); }
  });
  source.addEventListener("error", () => {
    if (status) status.classList.remove("on");
  });
}

document.addEventListener("DOMContentLoaded", () => {
  document.querySelectorAll("[data-live]").forEach(follow);
  document.querySelectorAll("[data-autosubmit]").forEach((control) => {
    control.addEventListener("change", () => control.form.submit());
    const shown = document.getElementById("version-ordinal");
    if (shown) control.addEventListener("input", () => { shown.textContent = control.value; });
  });
});
