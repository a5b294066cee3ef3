// Before the tests: say in one line what this machine lacks and how to get it, instead of failing obscurely.
import { execFileSync } from 'node:child_process';
import { existsSync } from 'node:fs';

const problems = [];
const [major, minor] = process.versions.node.split('.').map(Number);
if (major < 20 || (major === 20 && minor < 19)) {
  problems.push(`Node ${process.versions.node} is too old: svc needs Node >= 20.19`);
}
const tools = [
  { command: 'git', args: ['--version'], install: 'apt-get install -y git' },
  { command: 'bwrap', args: ['--version'], install: 'apt-get install -y bubblewrap' },
  { command: 'slirp4netns', args: ['--version'], install: 'apt-get install -y slirp4netns' },
];
for (const tool of tools) {
  try {
    execFileSync(tool.command, tool.args, { stdio: 'ignore' });
  } catch {
    problems.push(`${tool.command} is missing: install it with \`${tool.install}\``);
  }
}
// slirp4netns makes its tap device through the kernel's TUN driver.
if (!existsSync('/dev/net/tun')) {
  problems.push('/dev/net/tun is missing: slirp4netns needs the TUN device (`modprobe tun`, or give the container `--device /dev/net/tun`)');
}
if (problems.length > 0) {
  process.stderr.write(`svc tests cannot run: ${problems.join('; ')}\n`);
  process.exit(1);
}
