// Verifies one webhook request with the npm `standardwebhooks` library (not ours).
// stdin: JSON { secret, body (base64), headers }. Prints "verified" and exits 0, or
// prints the library's error and exits 1. Run by tests/common/verifiers.rs.
import { Webhook } from "standardwebhooks";

let input = "";
for await (const chunk of process.stdin) input += chunk;
const data = JSON.parse(input);
try {
  new Webhook(data.secret).verify(Buffer.from(data.body, "base64").toString("utf8"), data.headers);
  console.log("verified");
} catch (err) {
  console.log(`refused: ${err.message}`);
  process.exit(1);
}
