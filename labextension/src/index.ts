/**
 * rpcnb's JupyterLab extension: the "RPC" side panel and the status bar item for the
 * group of the notebook that has focus. The data comes from the kernel itself, over a
 * comm to the `rpcnb.panel` target (rpcnb/frontend/panel.py); no server extension, no
 * polling. This file registers the plugin; the comm is `comm.ts`, the views `panel.ts`,
 * the actions `actions.ts`, the data model `model.ts`.
 */

import {
  ILabShell,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { INotebookTracker } from '@jupyterlab/notebook';
import { IStatusBar } from '@jupyterlab/statusbar';

import { Link } from './comm';
import { PANEL_ID, RpcPanel, RpcStatus } from './panel';

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'rpcnb:panel',
  description: "rpcnb's RPC side panel and status bar item",
  autoStart: true,
  requires: [INotebookTracker],
  optional: [ILabShell, IStatusBar],
  activate: (
    app: JupyterFrontEnd,
    tracker: INotebookTracker,
    labShell: ILabShell | null,
    statusBar: IStatusBar | null
  ) => {
    const link = new Link();
    const panel = new RpcPanel(link);
    app.shell.add(panel, 'right', { rank: 900 });
    if (statusBar) {
      statusBar.registerStatusItem('rpcnb:status', {
        item: new RpcStatus(link, () => app.shell.activateById(PANEL_ID)),
        align: 'left',
        rank: 5
      });
    }
    tracker.currentChanged.connect((_, nb) => link.follow(nb));
    link.follow(tracker.currentWidget);
    app.commands.addCommand('rpcnb:open-panel', {
      label: 'Open the RPC panel',
      execute: () => app.shell.activateById(PANEL_ID)
    });
  }
};

export default plugin;
