// What a reader would see go wrong on a page at this window width: a picture that does not render, a table or code
// block wider than its container (cut off, or hidden behind a scrollbar), a row of a table in a code block (words
// parted by runs of spaces three times or more, as a plan table's) that wraps, a hyphenated word of code (a flag)
// broken over two lines. `checkPage(document)` returns them as data.
function checkPage(doc) {
  const win = doc.defaultView;
  const article = doc.querySelector("article.md-content__inner") || doc.body;
  const edge = article.getBoundingClientRect().right;
  const images = Array.from(doc.images).map(img => ({
    src: img.getAttribute("src"), width: img.naturalWidth, ok: img.complete && img.naturalWidth > 0}));
  const overflow = [];
  // Material frames a table in a scrolling div that reaches a little past the text on purpose: what counts is
  // whether anything scrolls, and whether a table or code block itself reaches past the text.
  for (const el of article.querySelectorAll("table, pre, pre > code, .md-typeset__scrollwrap")) {
    const over = el.scrollWidth - el.clientWidth;
    const past = el.matches(".md-typeset__scrollwrap") ? 0 : el.getBoundingClientRect().right - edge;
    if (over > 1 || past > 1) {
      overflow.push({tag: el.tagName.toLowerCase() + (el.className ? "." + el.className : ""), over: over,
                     past: past, text: el.textContent.trim().slice(0, 100)});
    }
  }
  const wrapped = [];
  const ctx = doc.createElement("canvas").getContext("2d");
  for (const code of article.querySelectorAll("pre > code")) {
    const style = win.getComputedStyle(code);
    ctx.font = style.fontSize + " " + style.fontFamily;
    const room = code.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
    for (const line of code.textContent.split("\n")) {
      if (/(\S+ {2,}){3,}\S/.test(line) && ctx.measureText(line).width > room + 1) {  // a row of a table
        wrapped.push({line: line.slice(0, 100), width: ctx.measureText(line).width, room: room});
      }
    }
  }
  const broken = Array.from(article.querySelectorAll("code .whole"))
    .filter(word => word.getClientRects().length > 1).map(word => word.textContent);
  return {width: win.innerWidth, images: images, overflow: overflow, wrapped: wrapped, broken: broken};
}

// Load each page of PAGES in turn in a frame of the window's width, check it once the site's own scripts have run,
// and write every result, as JSON, into a pre element of id "hfsplit-results" for --dump-dom.
async function checkAll(pages, width, height) {
  const results = {};
  for (const page of pages) {
    const frame = document.createElement("iframe");
    frame.style.cssText = `width:${width}px;height:${height}px;border:0;display:block`;
    const loaded = new Promise(resolve => frame.addEventListener("load", resolve, {once: true}));
    frame.src = page;
    document.body.appendChild(frame);
    await loaded;
    await new Promise(resolve => setTimeout(resolve, 300));
    try {
      results[page] = checkPage(frame.contentDocument);
    } catch (error) {
      results[page] = {error: String(error)};
    }
    frame.remove();
  }
  const out = document.createElement("pre");
  out.id = "hfsplit-results";
  out.textContent = JSON.stringify(results);
  document.body.appendChild(out);
}
