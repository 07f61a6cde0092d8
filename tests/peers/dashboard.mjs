// Drives the zonewatch dashboard in headless Chromium (Debian's chromium, no downloaded
// browser): the page must show the sources and an open hold, and a click on "release" must
// release it. It prints how many subscriber areas the map drew and the map's note. Usage: node dashboard.mjs BASE_URL TOKEN SCREENSHOT_PNG
import { createRequire } from "node:module";
const require = createRequire(process.env.ZW_PLAYWRIGHT_DIR + "/");
const { chromium } = require("playwright-core");

const [base, token, shot] = process.argv.slice(2);
const browser = await chromium.launch({
  executablePath: process.env.ZW_CHROMIUM || "/usr/bin/chromium",
  args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"],
});
try {
  const page = await browser.newPage({ viewport: { width: 1280, height: 900 } });
  const errors = [];
  page.on("pageerror", (e) => errors.push(String(e)));
  page.on("requestfailed", (r) => { if (!r.url().startsWith(base)) errors.push("external request: " + r.url()); });
  await page.goto(base + "/#token=" + token);
  await page.waitForSelector('#sources tr[data-source="s1"]', { timeout: 15000 });
  const verdict = await page.textContent('#sources tr[data-source="s1"] td:nth-child(2)');
  await page.waitForSelector('#holds tr[data-state="open"] button[data-action="release"]', { timeout: 15000 });
  await page.waitForSelector("#map path.aoi", { timeout: 15000 });
  const areas = await page.locator("#map path.aoi").count();
  const mapnote = await page.textContent("#mapnote");
  if (shot) await page.screenshot({ path: shot, fullPage: true });
  await page.click('#holds tr[data-state="open"] button[data-action="release"]');
  await page.waitForSelector('#holds tr[data-state="released"]', { timeout: 15000 });
  const status = await page.textContent("#status");
  if (errors.length) throw new Error("page errors: " + errors.join("; "));
  console.log(JSON.stringify({ ok: true, verdict, status, areas, mapnote }));
} finally {
  await browser.close();
}
