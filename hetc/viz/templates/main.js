// ---- main.js: start up; record how long it took, for tests and benchmarks:
// body[data-script-ms] from the data's parse to the index built, body[data-open-ms]
// from navigation start (HTML parse included).

installInteraction();
resize();
paint();
buildIndex();
applyHash();
document.body.dataset.scriptMs = (performance.now() - SCRIPT_T0).toFixed(1);
document.body.dataset.openMs = performance.now().toFixed(1);
document.body.dataset.ready = "1";
