// What does not fit on each page of PAGES ([its relative URL, [widths]]), the page loaded in a frame as wide
// as each window width (tests/e2e/test_docs.py): a table or code block that runs off the content column, one
// cut without a scrollbar, a word of a table split across lines; one line each, into <body data-fit>.
function unfit(doc, win) {
  const out = [];
  const main = doc.querySelector('article') || doc.body;
  const limit = main.getBoundingClientRect().right + 1;
  const name = (el) => (el.tagName + ' ' + (el.textContent || '').trim().slice(0, 40)).replace(/\s+/g, ' ');
  for (const el of main.querySelectorAll('table, pre')) {
    let box = el, scrolls = false;
    for (let a = el; a && a !== main; a = a.parentElement) {
      const ox = win.getComputedStyle(a).overflowX;
      if (ox === 'auto' || ox === 'scroll') { box = a; scrolls = true; break; }
    }
    const r = box.getBoundingClientRect();
    if (r.width && r.right > limit) out.push('runs off the column (' + Math.round(r.right) + ' > ' + Math.round(limit) + 'px): ' + name(el));
    else if (!scrolls && el.scrollWidth > el.clientWidth + 1) out.push('cut (' + el.scrollWidth + ' > ' + el.clientWidth + 'px): ' + name(el));
  }
  for (const cell of main.querySelectorAll('td, th')) {
    const walker = doc.createTreeWalker(cell, 4);
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
      for (const m of node.data.matchAll(/[A-Za-z0-9_]{2,}/g)) {
        const range = doc.createRange();
        range.setStart(node, m.index); range.setEnd(node, m.index + m[0].length);
        const tops = new Set([...range.getClientRects()].filter(q => q.width > 0).map(q => Math.round(q.top)));
        if (tops.size > 1) out.push('a word split across lines: ' + m[0]);
      }
    }
  }
  return out;
}
async function run() {
  const found = [];
  for (const [url, widths] of PAGES) {
    for (const width of widths) {
      const frame = document.createElement('iframe');
      frame.style.width = width + 'px'; frame.style.height = '900px';
      await new Promise((done) => { frame.onload = done; frame.src = url; document.body.appendChild(frame); });
      try {
        for (const line of unfit(frame.contentDocument, frame.contentWindow)) found.push(url + ' at ' + width + 'px: ' + line);
      } catch (e) { found.push(url + ' at ' + width + 'px: the page could not be measured: ' + e); }
      frame.remove();
    }
  }
  document.body.setAttribute('data-fit', JSON.stringify(found));
}
run();
