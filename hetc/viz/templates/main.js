// ---- main.js: start up, and record how long it took (read by tests and benchmarks):
// body[data-paint-ms]: from navigation start (HTML parse included) to the rows drawn;
// body[data-open-ms]: from navigation start to the DOM index built; body[data-script-ms]:
// from the data's parse to the index built; body[data-ready]="1" once all is in place.

installInteraction();
resize();
paint();
document.body.dataset.paintMs = performance.now().toFixed(1);
buildIndex(() => {
  applyHash();
  document.body.dataset.scriptMs = (performance.now() - SCRIPT_T0).toFixed(1);
  document.body.dataset.openMs = performance.now().toFixed(1);
  document.body.dataset.ready = "1";
});
