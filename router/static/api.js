// Calls to duet's REST API with the API key from this tab's session storage. A 401 asks for
// the key (the dialog in the page) and retries once it is given.
"use strict";

(function () {
  const KEY = "duet.apiKey";
  let waiting = null; // one prompt at a time

  function headers(extra) {
    const h = Object.assign({}, extra || {});
    const key = sessionStorage.getItem(KEY);
    if (key) h["Authorization"] = "Bearer " + key;
    return h;
  }

  function askKey(message) {
    if (waiting) return waiting;
    const dialog = document.getElementById("key-dialog");
    const form = document.getElementById("key-form");
    const input = document.getElementById("api-key");
    const err = document.getElementById("key-error");
    err.hidden = !message;
    err.textContent = message || "";
    input.value = "";
    waiting = new Promise((resolve) => {
      form.onsubmit = (ev) => {
        ev.preventDefault();
        const key = input.value.trim();
        if (!key) return;
        sessionStorage.setItem(KEY, key);
        dialog.close();
        waiting = null;
        resolve();
      };
    });
    if (!dialog.open) dialog.showModal();
    return waiting;
  }

  // fetch() with the key; on 401 asks for a (new) key and retries. Other statuses return.
  async function call(path, options) {
    const opts = Object.assign({}, options || {});
    for (;;) {
      opts.headers = headers(options && options.headers);
      const resp = await fetch(path, opts);
      if (resp.status !== 401) return resp;
      const had = sessionStorage.getItem(KEY);
      await askKey(had ? "That key was refused; enter another." : "");
    }
  }

  async function json(path, options) {
    const resp = await call(path, options);
    let body = null;
    try {
      body = await resp.json();
    } catch (e) {
      body = null;
    }
    if (!resp.ok) {
      const msg = body && body.error ? body.error.message : resp.status + " " + resp.statusText;
      const e = new Error(msg);
      e.status = resp.status;
      throw e;
    }
    return body;
  }

  window.duetApi = { call, json, askKey, forgetKey: () => sessionStorage.removeItem(KEY) };
})();
