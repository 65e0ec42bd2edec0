window.addEventListener('load', () => {
  const out = [];
  const main = document.querySelector('article') || document.body;
  const limit = main.getBoundingClientRect().right + 1;
  const name = (el) => (el.tagName + ' ' + (el.textContent || '').trim().slice(0, 40)).replace(/\s+/g, ' ');
  for (const el of main.querySelectorAll('table, pre')) {
    let box = el, scrolls = false;
    for (let a = el; a && a !== main; a = a.parentElement) {
      const ox = getComputedStyle(a).overflowX;
      if (ox === 'auto' || ox === 'scroll') { box = a; scrolls = true; break; }
    }
    const r = box.getBoundingClientRect();
    if (r.width && r.right > limit) out.push('runs off the column (' + Math.round(r.right) + ' > ' + Math.round(limit) + 'px): ' + name(el));
    else if (!scrolls && el.scrollWidth > el.clientWidth + 1) out.push('cut (' + el.scrollWidth + ' > ' + el.clientWidth + 'px): ' + name(el));
  }
  for (const cell of main.querySelectorAll('td, th')) {
    const walker = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
      for (const m of node.data.matchAll(/[A-Za-z0-9_]{2,}/g)) {
        const range = document.createRange();
        range.setStart(node, m.index); range.setEnd(node, m.index + m[0].length);
        const tops = new Set([...range.getClientRects()].filter(q => q.width > 0).map(q => Math.round(q.top)));
        if (tops.size > 1) out.push('a word split across lines: ' + m[0]);
      }
    }
  }
  document.body.setAttribute('data-fit', JSON.stringify(out));
});
