// Koop test peer for zonewatch: serves every <name>.geojson in DATA_DIR (relative to the
// working directory) as an ArcGIS FeatureServer layer at
//   http://127.0.0.1:<port>/file-geojson/rest/services/<name>/FeatureServer/0
// A top-level "metadata": {"maxRecordCount": N} in the file sets the layer's page size.
// Usage: node server.js <port|0> <dataDir>; prints "LISTENING <port>" once ready.
const Koop = require('@koopjs/koop-core');
const provider = require('@koopjs/provider-file-geojson');
const koop = new Koop({ logLevel: 'error' });
koop.register(provider, { dataDir: process.argv[3] || 'data' });
const srv = koop.server.listen(Number(process.argv[2] || 0), '127.0.0.1', () => {
  console.log('LISTENING ' + srv.address().port);
});
