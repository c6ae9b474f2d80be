// Safe Markdown for model output: builds DOM nodes with textContent only, never innerHTML, so
// a reply containing <script> or <img onerror=...> shows as text. Supports fenced code blocks,
// inline code, **bold**, *italic*, # headings, - and 1. lists, [links](https://...), paragraphs.
"use strict";

(function () {
  const SAFE_URL = /^(https?:|mailto:)/i;

  function el(tag, cls, text) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  // Inline spans: code first (its content is literal), then links, bold, italic.
  const INLINE = /(`[^`\n]+`)|(\[[^\]\n]+\]\([^)\s]+\))|(\*\*[^*\n]+\*\*)|(\*[^*\n]+\*)/g;

  function appendInline(parent, text) {
    let last = 0;
    for (const m of text.matchAll(INLINE)) {
      if (m.index > last) parent.appendChild(document.createTextNode(text.slice(last, m.index)));
      const tok = m[0];
      if (m[1]) {
        parent.appendChild(el("code", null, tok.slice(1, -1)));
      } else if (m[2]) {
        const close = tok.indexOf("](");
        const label = tok.slice(1, close);
        const href = tok.slice(close + 2, -1);
        if (SAFE_URL.test(href)) {
          const a = el("a", null, label);
          a.href = href;
          a.target = "_blank";
          a.rel = "noopener noreferrer";
          parent.appendChild(a);
        } else {
          parent.appendChild(document.createTextNode(tok));
        }
      } else if (m[3]) {
        const b = el("strong");
        appendInline(b, tok.slice(2, -2));
        parent.appendChild(b);
      } else {
        const i = el("em");
        appendInline(i, tok.slice(1, -1));
        parent.appendChild(i);
      }
      last = m.index + tok.length;
    }
    if (last < text.length) parent.appendChild(document.createTextNode(text.slice(last)));
  }

  // Renders `source` into a new <div class="md">. An unclosed code fence (a reply still
  // streaming) renders as a code block up to the end.
  function render(source) {
    const root = el("div", "md");
    const lines = String(source).split("\n");
    let para = [];
    let list = null;
    const flushPara = () => {
      if (para.length) {
        const p = el("p");
        para.forEach((line, i) => {
          if (i) p.appendChild(el("br"));
          appendInline(p, line);
        });
        root.appendChild(p);
        para = [];
      }
    };
    const flushList = () => {
      list = null;
    };
    for (let i = 0; i < lines.length; i++) {
      const line = lines[i];
      const fence = line.match(/^\s*```\s*([\w+-]*)\s*$/);
      if (fence) {
        flushPara();
        flushList();
        const code = [];
        i++;
        while (i < lines.length && !/^\s*```\s*$/.test(lines[i])) code.push(lines[i++]);
        const pre = el("pre");
        const c = el("code", fence[1] ? "lang-" + fence[1] : null, code.join("\n"));
        pre.appendChild(c);
        root.appendChild(pre);
        continue;
      }
      const heading = line.match(/^(#{1,6})\s+(.*)$/);
      const bullet = line.match(/^\s*[-*+]\s+(.*)$/);
      const numbered = line.match(/^\s*\d+[.)]\s+(.*)$/);
      if (heading) {
        flushPara();
        flushList();
        const h = el("h" + Math.min(6, heading[1].length + 2));
        appendInline(h, heading[2]);
        root.appendChild(h);
      } else if (bullet || numbered) {
        flushPara();
        const tag = bullet ? "ul" : "ol";
        if (!list || list.tagName.toLowerCase() !== tag) {
          list = el(tag);
          root.appendChild(list);
        }
        const li = el("li");
        appendInline(li, (bullet || numbered)[1]);
        list.appendChild(li);
      } else if (!line.trim()) {
        flushPara();
        flushList();
      } else {
        flushList();
        para.push(line);
      }
    }
    flushPara();
    return root;
  }

  window.duetMarkdown = { render };
})();
