// The chat page: streams replies over POST /v1/chat/completions (SSE), keeps conversations
// in duet's sessions API (the open one is in the URL's #session=ID, so a reload resumes it),
// and shows each reply's time to first token and tokens per second. The settings and each
// stored reply's numbers are kept in this browser's localStorage (never the API key), so a
// reload finds them again.
"use strict";

(function () {
  const $ = (id) => document.getElementById(id);
  const api = window.duetApi;
  const md = window.duetMarkdown;
  const SETTINGS_KEY = "duet.chat.settings";
  const STATS_PREFIX = "duet.chat.stats."; // + session id: {message index: "TTFT ... tokens"}
  const SETTING_FIELDS = { "system-prompt": "system", temperature: "temperature", "max-tokens": "max_tokens" };
  const state = {
    model: null,
    sessionsOn: true,
    sessionId: null,
    history: [], // this tab's messages when sessions are off
    numStored: 0, // messages stored in the open session
    controller: null,
  };

  function showError(msg) {
    $("error").hidden = !msg;
    $("error").textContent = msg || "";
  }

  // -- what this browser keeps -------------------------------------------------------------

  function stored(key) {
    try {
      return JSON.parse(localStorage.getItem(key) || "null");
    } catch (e) {
      return null; // storage off, or an unreadable entry: start from the defaults
    }
  }

  function store(key, value) {
    try {
      if (value === null) localStorage.removeItem(key);
      else localStorage.setItem(key, JSON.stringify(value));
    } catch (e) {} // storage full or off: the page works, it only forgets on reload
  }

  function restoreSettings() {
    const saved = stored(SETTINGS_KEY) || {};
    for (const [id, name] of Object.entries(SETTING_FIELDS)) {
      if (typeof saved[name] === "string") $(id).value = saved[name];
    }
  }

  function saveSettings() {
    const values = {};
    for (const [id, name] of Object.entries(SETTING_FIELDS)) values[name] = $(id).value;
    store(SETTINGS_KEY, values);
  }

  function keepStats(sessionId, index, text) {
    const all = stored(STATS_PREFIX + sessionId) || {};
    all[index] = text;
    store(STATS_PREFIX + sessionId, all);
  }

  function addMessage(role, content) {
    const div = document.createElement("div");
    div.className = "msg " + role;
    const who = document.createElement("div");
    who.className = "role";
    who.textContent = role;
    const body = document.createElement("div");
    body.className = "body";
    div.append(who, body);
    const stats = document.createElement("div");
    stats.className = "stats";
    div.appendChild(stats);
    setContent(div, content);
    $("messages").appendChild(div);
    div.scrollIntoView({ block: "end" });
    return div;
  }

  function setContent(div, content) {
    const body = div.querySelector(".body");
    body.replaceChildren(md.render(content || ""));
  }

  // -- sessions ---------------------------------------------------------------------------

  async function loadSessions() {
    let list;
    try {
      list = await api.json("/v1/sessions");
    } catch (e) {
      if (e.status === 404) {
        state.sessionsOn = false;
        $("sessions-off").hidden = false;
        return;
      }
      throw e;
    }
    const ul = $("sessions");
    ul.replaceChildren();
    const items = list.data.slice().sort((a, b) => b.updated_at - a.updated_at);
    for (const s of items) {
      const li = document.createElement("li");
      li.dataset.id = s.id;
      if (s.id === state.sessionId) li.className = "current";
      const open = document.createElement("button");
      open.type = "button";
      open.className = "open";
      open.textContent = (s.metadata && s.metadata.title) || s.id;
      open.title = s.num_messages + " messages";
      open.onclick = () => resume(s.id);
      const del = document.createElement("button");
      del.type = "button";
      del.className = "delete";
      del.textContent = "\u00d7";
      del.title = "Delete this conversation";
      del.onclick = () => remove(s.id);
      li.append(open, del);
      ul.appendChild(li);
    }
  }

  async function resume(id) {
    if (state.controller) return;
    let s;
    try {
      s = await api.json("/v1/sessions/" + encodeURIComponent(id));
    } catch (e) {
      showError("Cannot open that conversation: " + e.message);
      return;
    }
    state.sessionId = id;
    state.numStored = s.messages.length;
    location.hash = "session=" + id;
    $("messages").replaceChildren();
    const stats = stored(STATS_PREFIX + id) || {};
    s.messages.forEach((m, i) => {
      if (m.role === "system") return;
      const div = addMessage(m.role, m.content);
      if (m.role === "assistant" && typeof stats[i] === "string") {
        div.querySelector(".stats").textContent = stats[i];
      }
    });
    closeSidebar();
    showError("");
    await loadSessions();
  }

  async function remove(id) {
    try {
      await api.json("/v1/sessions/" + encodeURIComponent(id), { method: "DELETE" });
    } catch (e) {
      showError("Cannot delete: " + e.message);
      return;
    }
    store(STATS_PREFIX + id, null);
    if (id === state.sessionId) newChat();
    await loadSessions();
  }

  function newChat() {
    if (state.controller) return;
    state.sessionId = null;
    state.numStored = 0;
    state.history = [];
    history.replaceState(null, "", location.pathname);
    $("messages").replaceChildren();
    closeSidebar();
    showError("");
    loadSessions().catch((e) => showError(e.message));
  }

  // -- sending ----------------------------------------------------------------------------

  function settings() {
    const temperature = parseFloat($("temperature").value);
    const maxTokens = parseInt($("max-tokens").value, 10);
    if (!(temperature >= 0 && temperature <= 2)) throw new Error("Temperature: must be in [0, 2]");
    if (!(maxTokens >= 1)) throw new Error("Max tokens: must be at least 1");
    return { temperature, max_tokens: maxTokens, system: $("system-prompt").value.trim() };
  }

  async function send(text) {
    let opts;
    try {
      opts = settings();
    } catch (e) {
      showError(e.message);
      return;
    }
    showError("");
    const messages = [];
    const firstTurn = state.sessionsOn ? state.numStored === 0 : state.history.length === 0;
    if (opts.system && firstTurn) messages.push({ role: "system", content: opts.system });
    if (!state.sessionsOn) messages.unshift(...state.history);
    messages.push({ role: "user", content: text });
    if (state.sessionsOn && !state.sessionId) {
      const created = await api.json("/v1/sessions", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify({ metadata: { title: text.slice(0, 80) } }),
      });
      state.sessionId = created.id;
      location.hash = "session=" + created.id;
    }
    addMessage("user", text);
    const reply = addMessage("assistant", "");
    reply.classList.add("streaming");
    const body = {
      model: state.model,
      messages,
      stream: true,
      stream_options: { include_usage: true },
      temperature: opts.temperature,
      max_tokens: opts.max_tokens,
    };
    if (state.sessionsOn) body.session_id = state.sessionId;
    const result = await stream(body, reply);
    reply.classList.remove("streaming");
    if (result.completed) {
      if (state.sessionsOn) {
        // The reply is the session's message after this turn's: its numbers stay with it.
        keepStats(state.sessionId, state.numStored + messages.length, result.stats);
        state.numStored += messages.length + 1;
      }
      else state.history = messages.concat([{ role: "assistant", content: result.text }]);
    }
    if (state.sessionsOn) loadSessions().catch(() => {});
  }

  // Streams one reply into `div`; {completed, text}. Stop aborts the fetch, which closes the
  // connection: the server aborts the request and frees its KV blocks.
  async function stream(body, div) {
    const controller = new AbortController();
    state.controller = controller;
    setBusy(true);
    const t0 = performance.now();
    let tFirst = null;
    let tLast = null;
    let numChunks = 0;
    let numTokens = null;
    let text = "";
    let completed = false;
    let pending = false;
    const paint = () => {
      pending = false;
      setContent(div, text);
      div.scrollIntoView({ block: "end" });
    };
    try {
      const resp = await api.call("/v1/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify(body),
        signal: controller.signal,
      });
      if (!resp.ok) {
        let msg = resp.status + " " + resp.statusText;
        try {
          msg = (await resp.json()).error.message;
        } catch (e) {}
        throw new Error(msg);
      }
      const reader = resp.body.getReader();
      const decoder = new TextDecoder();
      let buf = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buf.indexOf("\n\n")) >= 0) {
          const event = buf.slice(0, cut);
          buf = buf.slice(cut + 2);
          for (const line of event.split("\n")) {
            if (!line.startsWith("data:")) continue;
            const data = line.slice(5).trim();
            if (data === "[DONE]") {
              completed = true;
              continue;
            }
            const chunk = JSON.parse(data);
            if (chunk.error) throw new Error(chunk.error.message);
            if (chunk.usage) numTokens = chunk.usage.completion_tokens;
            const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
            if (delta && delta.content) {
              const now = performance.now();
              if (tFirst === null) tFirst = now;
              tLast = now;
              numChunks += 1;
              text += delta.content;
              if (!pending) {
                pending = true;
                requestAnimationFrame(paint);
              }
            }
          }
        }
      }
    } catch (e) {
      if (e.name === "AbortError") div.classList.add("stopped");
      else showError(e.message);
    } finally {
      state.controller = null;
      setBusy(false);
      paint();
    }
    const n = numTokens !== null ? numTokens : numChunks;
    const parts = [];
    if (tFirst !== null) parts.push("TTFT " + Math.round(tFirst - t0) + " ms");
    if (tFirst !== null && tLast > tFirst && n > 1) {
      parts.push(((n - 1) / ((tLast - tFirst) / 1000)).toFixed(1) + " tok/s");
    }
    parts.push(n + " tokens");
    if (!completed) parts.push("stopped");
    const stats = parts.join(" \u00b7 ");
    div.querySelector(".stats").textContent = stats;
    return { completed, text, stats };
  }

  function setBusy(busy) {
    $("send").hidden = busy;
    $("stop").hidden = !busy;
    $("prompt").disabled = false;
  }

  // -- wiring -----------------------------------------------------------------------------

  $("composer").onsubmit = (ev) => {
    ev.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || state.controller) return;
    $("prompt").value = "";
    send(text).catch((e) => showError(e.message));
  };
  $("prompt").onkeydown = (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) {
      ev.preventDefault();
      $("composer").requestSubmit();
    }
  };
  $("stop").onclick = () => state.controller && state.controller.abort();
  $("new-chat").onclick = newChat;
  $("settings-toggle").onclick = () => {
    const s = $("settings");
    s.hidden = !s.hidden;
    $("settings-toggle").setAttribute("aria-expanded", String(!s.hidden));
  };
  for (const id of Object.keys(SETTING_FIELDS)) $(id).addEventListener("input", saveSettings);
  // Phones: the conversations list slides in over the chat.
  function closeSidebar() {
    document.body.classList.remove("sidebar-open");
    $("sidebar-toggle").setAttribute("aria-expanded", "false");
  }
  $("sidebar-toggle").onclick = () => {
    const open = document.body.classList.toggle("sidebar-open");
    $("sidebar-toggle").setAttribute("aria-expanded", String(open));
  };
  $("messages").addEventListener("click", closeSidebar);
  $("change-key").onclick = () => {
    api.forgetKey();
    start();
  };

  async function start() {
    restoreSettings();
    try {
      const models = await api.json("/v1/models");
      state.model = models.data[0].id;
      $("model").textContent = state.model;
      await loadSessions();
      const m = location.hash.match(/session=([\w.-]+)/);
      if (m && state.sessionsOn) await resume(m[1]);
    } catch (e) {
      showError(e.message);
    }
  }

  start();
})();
