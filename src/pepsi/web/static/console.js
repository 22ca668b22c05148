// Live refresh: elements with data-live="URL" are replaced by the HTML fragment at URL
// every data-every seconds (default 2), without reloading the page.
"use strict";
document.addEventListener("DOMContentLoaded", () => {
  for (const el of document.querySelectorAll("[data-live]")) {
    const every = 1000 * Number(el.dataset.every || 2);
    const refresh = async () => {
      try {
        const response = await fetch(el.dataset.live, { credentials: "same-origin" });
        if (response.redirected && new URL(response.url).pathname === "/login") {
          window.location.assign(response.url); // the session ended: log in again
          return;
        }
        if (response.ok) el.innerHTML = await response.text();
      } catch (_) { /* the next tick tries again */ }
      setTimeout(refresh, every);
    };
    setTimeout(refresh, every);
  }
});
